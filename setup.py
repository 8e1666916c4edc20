"""Builds hetcomm and its C++ extension hetcomm._C.

    pip install --no-build-isolation -e .

--no-build-isolation matters: the extension must compile against the torch that is installed,
not against whatever torch pip would fetch into an isolated build environment.
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def cpp_sources():
    sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cc"), recursive=True))
    return sources + ["csrc/bindings.cpp"]


ext = CppExtension(
    name="hetcomm._C",
    sources=cpp_sources(),
    include_dirs=[os.path.join(ROOT, "csrc")],
    extra_compile_args=["-O3", "-std=c++17", "-Wall", "-Wno-unused-parameter"],
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
