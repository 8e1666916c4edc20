"""Builds hetcomm and its C++ extension hetcomm._C.

    pip install --no-build-isolation -e .

--no-build-isolation matters: the extension must compile against the torch that is installed,
not against whatever torch pip would fetch into an isolated build environment.
"""
import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = ["-O3", "-std=c++17", "-Wall", "-Wno-unused-parameter"]


def cpp_sources():
    sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cc"), recursive=True))
    return sources + ["csrc/bindings.cpp"]


def with_cuda() -> bool:
    """The CUDA kernels (csrc/**/*.cu) go in only when torch itself was built with CUDA and nvcc
    is there; a GPU is not needed to build. Anything else builds the CPU-only extension."""
    return torch.version.cuda is not None and CUDA_HOME is not None and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))


if with_cuda():
    # Without TORCH_CUDA_ARCH_LIST torch compiles for the GPUs it sees, or, with none in sight, for
    # every architecture it knows (slow). Default to the CMake build's: sm_80 and sm_90 machine
    # code (sm_86/sm_89 run the sm_80 code) and compute_90 PTX for newer GPUs.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    ext = CUDAExtension(
        name="hetcomm._C",
        sources=cpp_sources() + sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True)),
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=[("HETCOMM_WITH_CUDA", None)],
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3", "-std=c++17", "-Xcompiler=-Wall,-Wno-unused-parameter"]},
    )
else:
    ext = CppExtension(
        name="hetcomm._C",
        sources=cpp_sources(),
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args=CXX_FLAGS,
    )

setup(
    name="hetcomm",
    version="0.1.0",
    description="Heterogeneity-aware collectives for PyTorch: a torch.distributed backend with a weighted ring AllReduce",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["numpy", "scipy"],
    extras_require={"test": ["pytest", "pytest-benchmark", "expecttest"]},
)
