"""Builds hetcomm and its C++ extension hetcomm._C.

    pip install --no-build-isolation -e .

--no-build-isolation matters: the extension must compile against the torch that is installed,
not against whatever torch pip would fetch into an isolated build environment.
"""
import glob
import hashlib
import os
import shlex
import shutil
import subprocess


def set_cuda_home() -> None:
    """Points CUDA_HOME at a CUDA installation with headers, unless the user set it.

    torch looks for CUDA at $CUDA_HOME, else two folders above `which nvcc`. Where nvcc on PATH
    is a wrapper script or a link (/usr/local/bin/nvcc on our machines), that guess is /usr/local,
    which has no cuda_runtime.h, and the build fails halfway. Here the first folder that has both
    bin/nvcc and include/cuda_runtime.h wins: nvcc's own (links followed), /usr/local/cuda, then
    /usr/local/cuda-* newest first.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for home in candidates:
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and \
                os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = home
            return


set_cuda_home()  # before torch.utils.cpp_extension reads it

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
# -g0: without debug information (as torch's own wheels), which Python's flags ask for (-g) and
# which costs 40% of the compile time; symbols stay, so a backtrace still names the functions.
# HETCOMM_DEBUG_INFO=1 keeps it (line numbers in gdb).
DEBUG_INFO = ["-g"] if os.environ.get("HETCOMM_DEBUG_INFO") == "1" else ["-g0"]
CXX_FLAGS = ["-O3", "-std=c++17", "-Wall", "-Wno-unused-parameter"] + DEBUG_INFO


def shared_libstdcxx() -> list:
    """Link arguments that make the extension use the shared libstdc++ torch itself runs with.

    Some toolchains link libstdc++ statically by default (seen with the /opt/gcc of our GPU
    machines): the extension then carries a second copy of the C++ runtime beside the one torch
    loaded, and the first std::ostringstream it builds crashes the process. Naming the very
    library this process has mapped (torch loaded it) as a linker input, ahead of the driver's
    own -lstdc++, makes the linker resolve everything against it, dynamically.
    """
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so") and os.path.exists(path):
                    return [path]
    except OSError:
        pass
    return ["-lstdc++"]


LINK_FLAGS = shared_libstdcxx()


# The torch-free part of the core (CMakeLists.txt: hetcomm_base). scripts/test.sh builds it once
# with CMake, for the C++ tests, and points HETCOMM_PREBUILT_BASE at the archive so that the
# extension links it instead of compiling the same files a second time.
BASE_DIRS = ("kernels", "algorithms", "transport")
PREBUILT_BASE = os.environ.get("HETCOMM_PREBUILT_BASE", "")


def cpp_sources():
    sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cc"), recursive=True))
    if PREBUILT_BASE:
        if not os.path.isfile(PREBUILT_BASE):
            raise SystemExit(f"HETCOMM_PREBUILT_BASE={PREBUILT_BASE}: no such file (build hetcomm_base with CMake first)")
        base = tuple(os.path.join("csrc", d) + os.sep for d in BASE_DIRS)
        sources = [s for s in sources if not s.startswith(base)]
    return sources + ["csrc/bindings.cpp"]


def prebuilt_base_link_args() -> list:
    return [os.path.abspath(PREBUILT_BASE), "-ldl"] if PREBUILT_BASE else []


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
        extra_link_args=prebuilt_base_link_args() + LINK_FLAGS,
    )
else:
    ext = CppExtension(
        name="hetcomm._C",
        sources=cpp_sources(),
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args=CXX_FLAGS,
        extra_link_args=prebuilt_base_link_args() + LINK_FLAGS,
    )

# Torch's headers that the extension's translation units include, precompiled once per build:
# parsing them (ATen/ATen.h under c10d's Backend.hpp) costs about 15 s of a core in every
# translation unit, most of the extension's build time on the 2-core machines CI runs on.
PCH_HEADERS = ("ATen/ATen.h", "ATen/core/ivalue.h", "torch/csrc/distributed/c10d/Backend.hpp",
               "torch/csrc/distributed/c10d/PrefixStore.hpp", "torch/csrc/distributed/c10d/Store.hpp",
               "torch/csrc/distributed/c10d/TCPStore.hpp", "torch/csrc/distributed/c10d/Types.hpp",
               "torch/csrc/distributed/c10d/Work.hpp")


def _make_paths(text: str) -> list:
    """The paths a make-style rule lists (``target: dep dep \\``): GCC escapes a space in a path
    as ``\\ `` and a dollar sign as ``$$``; quotes are plain characters."""
    paths, current, i = [], "", 0
    text = text.replace("\\\n", " ")
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in " #\\":
            current, i = current + text[i + 1], i + 2
            continue
        if c == "$" and text[i + 1:i + 2] == "$":
            current, i = current + "$", i + 2
            continue
        if c.isspace():
            if current:
                paths.append(current)
            current = ""
        else:
            current += c
        i += 1
    if current:
        paths.append(current)
    return paths


def _dependencies_digest(depfile: str) -> str:
    """Path, size and modification time of every file a make-style dependency file lists (the
    headers the precompiled header was made from): a torch whose headers changed under the same
    version string makes it again."""
    with open(depfile) as f:
        text = f.read()
    target, colon, deps = text.partition(": ")
    h = hashlib.sha256()
    for path in _make_paths(deps if colon else ""):
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def precompile_torch_headers(build_directory: str, cflags: list, post_cflags: list):
    """Compiles PCH_HEADERS into a GCC precompiled header in ``build_directory``, with exactly
    the flags (already shell-quoted) that the translation units are compiled with, and returns
    the header to force-include (``-include``), or None where GCC would not take it (then the
    units are compiled as without). Made again when the compiler, the flags, torch's version or
    any header it was made from changes; checked with -Werror=invalid-pch before it is used, and
    made once more if GCC refuses it (a compiler that changed under the same version text)."""
    compiler = shlex.quote(os.environ.get("CXX", "c++"))   # as torch's build.ninja names it
    version = subprocess.run(f"{compiler} --version", shell=True, capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version:
        return None          # GCC only: clang makes a mismatched or outdated .gch a hard error
    header = os.path.join(os.path.abspath(build_directory), "hetcomm_torch_headers.h")
    gch, depfile, stamp_path = header + ".gch", header + ".d", header + ".stamp"
    make = f"{compiler} {' '.join(cflags)} -x c++-header {shlex.quote(header)} -o {shlex.quote(gch + '.partial')} " \
           f"-MD -MF {shlex.quote(depfile)} {' '.join(post_cflags)}"
    where = shutil.which(os.environ.get("CXX", "c++")) or ""
    made_from = "\n".join([make, os.path.realpath(where) if where else "", version, torch.__version__,
                           str(torch.version.git_version), *PCH_HEADERS,
                           *(os.environ.get(v, "") for v in ("CPATH", "CPLUS_INCLUDE_PATH"))])

    def stamp() -> str:
        return hashlib.sha256(f"{made_from}\n{_dependencies_digest(depfile)}".encode()).hexdigest()

    def current() -> bool:
        try:
            with open(stamp_path) as f:
                return os.path.exists(gch) and f.read() == stamp()
        except OSError:
            return False

    def remake() -> None:
        os.makedirs(build_directory, exist_ok=True)
        for stale in (stamp_path, gch):
            if os.path.exists(stale):
                os.remove(stale)
        with open(header, "w") as f:
            f.write("// Written by setup.py: torch's headers, precompiled once for every translation unit.\n")
            f.writelines(f"#include <{h}>\n" for h in PCH_HEADERS)
        print("hetcomm: precompiling torch's headers", flush=True)
        subprocess.run(make, shell=True, check=True)
        os.replace(gch + ".partial", gch)
        with open(stamp_path, "w") as f:
            f.write(stamp())

    def taken() -> subprocess.CompletedProcess:
        # GCC takes a .gch silently or not at all: a one-line unit that must take it
        probe = os.path.join(os.path.abspath(build_directory), "hetcomm_pch_probe.cc")
        with open(probe, "w") as f:
            f.write("int hetcomm_pch_probe;\n")
        return subprocess.run(f"{compiler} {' '.join(cflags)} -fsyntax-only {shlex.quote(probe)} "
                              f"{' '.join(post_cflags)} -include {shlex.quote(header)} -Werror=invalid-pch",
                              shell=True, capture_output=True, text=True)

    made = not current()
    if made:
        remake()
    check = taken()
    if check.returncode != 0 and not made:      # (one made in this call is not made twice)
        remake()
        check = taken()
    if check.returncode != 0:
        print(f"hetcomm: GCC does not take the precompiled torch headers; building without:\n{check.stderr[-2000:]}",
              flush=True)
        return None
    return header


def with_precompiled_torch_headers(compile_objects):
    """Wraps torch.utils.cpp_extension's ninja compile step so that the C++ translation units
    force-include the precompiled torch headers. Where torch's step has another shape, a compiler
    cache would wrap the compiler (it would not cache units that include a .gch), or
    precompiling fails, the build goes on as without (slower, never different)."""
    from torch.utils import cpp_extension
    wrapper = getattr(cpp_extension, "_wrap_compiler", lambda c: [c])

    def compile_with_pch(*args, **kwargs):
        if args or not isinstance(kwargs.get("cflags"), list) or not isinstance(kwargs.get("post_cflags"), list) \
                or "build_directory" not in kwargs or os.environ.get("HETCOMM_NO_PCH") == "1" \
                or len(wrapper(os.environ.get("CXX", "c++"))) > 1:
            return compile_objects(*args, **kwargs)
        try:
            header = precompile_torch_headers(kwargs["build_directory"], kwargs["cflags"], kwargs["post_cflags"])
        except Exception as e:  # noqa: BLE001 - the header only saves time: never fail the build for it
            print(f"hetcomm: torch's headers not precompiled ({type(e).__name__}: {e}); building without", flush=True)
            header = None
        if header:
            # -fpch-deps: each unit's dependency file lists the headers the .gch was made from,
            # so that ninja rebuilds the units when torch's headers change
            kwargs["post_cflags"] = kwargs["post_cflags"] + ["-include", shlex.quote(header), "-Winvalid-pch",
                                                             "-fpch-deps"]
        return compile_objects(**kwargs)
    return compile_with_pch


class BuildAndRecord(BuildExtension.with_options(use_ninja=True)):
    """Builds hetcomm._C, then records what the build contains beside it (hetcomm/_build_info.py,
    git-ignored), where `import hetcomm` reads it without loading the extension: the backend
    registers for the device types the build moves. Written only by a build that succeeded, next
    to the extension it describes (in the source tree for an editable install, in the wheel
    otherwise)."""

    def run(self):
        from torch.utils import cpp_extension
        compile_objects = getattr(cpp_extension, "_write_ninja_file_and_compile_objects", None)
        if compile_objects is not None and os.name == "posix":
            cpp_extension._write_ninja_file_and_compile_objects = with_precompiled_torch_headers(compile_objects)
        try:
            super().run()
        finally:
            if compile_objects is not None:
                cpp_extension._write_ninja_file_and_compile_objects = compile_objects
        target = os.path.dirname(self.get_ext_fullpath("hetcomm._C"))
        with open(os.path.join(target, "_build_info.py"), "w") as f:
            f.write('"""Written by setup.py when it built hetcomm._C: what the build contains."""\n'
                    f"WITH_CUDA = {with_cuda()!r}\n")


setup(
    name="hetcomm",
    version="0.1.0",
    description="Heterogeneity-aware collectives for PyTorch: a torch.distributed backend with a weighted ring AllReduce",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildAndRecord},
    python_requires=">=3.9",
    install_requires=["numpy", "scipy"],
    extras_require={"test": ["pytest", "pytest-benchmark", "expecttest"]},
)
