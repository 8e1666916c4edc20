"""What importing hetcomm loads: the package face stays light, and the planner stays pure.

* ``import hetcomm`` registers the backend and loads neither the compiled extension nor the
  training classes (they load on first use, and the extension with the first hetcomm group);
* the planner, the simulator's spec, the benchmark's CLI and its analysis import neither torch
  nor the extension (data flows probe -> model -> plan -> backend; nothing in plan/ imports torch);
* a gloo-only benchmark run never loads the extension, in any of its processes;
* one module, ``hetcomm/_engine.py``, imports the extension, and the codecs do not use
  torch.distributed (read from the sources).

Each check runs in a fresh interpreter: what a module imports is only visible before anything
else has imported it.
"""
from __future__ import annotations

import ast
import glob
import os
import subprocess
import sys
import textwrap

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)
PACKAGE = os.path.join(ROOT, "python", "hetcomm")


def _run(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_import_hetcomm_registers_the_backend_and_loads_nothing_else() -> None:
    proc = _run("""
        import sys
        import hetcomm
        import torch.distributed as dist
        assert "hetcomm" in dist.Backend.backend_list, dist.Backend.backend_list
        heavy = sorted(m for m in sys.modules if m == "hetcomm._C" or m.startswith(("hetcomm.train", "hetcomm.topology",
                       "hetcomm.plan", "hetcomm.compress", "scipy")))
        assert not heavy, heavy
        # ... and the public names still resolve, on first use
        assert hetcomm.DiLoCo.__module__ == "hetcomm.train.diloco.loop"
        assert hetcomm.StoreUnreachable is hetcomm.train.membership.StoreUnreachable
        assert hetcomm.compress.weighted_allreduce is not None and hetcomm.hooks is hetcomm.train.hooks
        assert "hetcomm._C" not in sys.modules
        assert set(hetcomm.__all__) <= set(dir(hetcomm)), set(hetcomm.__all__) - set(dir(hetcomm))
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# hetcomm/__init__ registers the backend, which imports torch.distributed: a stand-in package
# takes its place, so that what is checked is the modules themselves and what they import.
PURE_MODULES = ("hetcomm.plan", "hetcomm.planner", "hetcomm.rates", "hetcomm.labels", "hetcomm.sim",
                "hetcomm.sim.spec", "hetcomm.bench.cli", "hetcomm.bench.analysis", "hetcomm.bench.report",
                "hetcomm._engine")
PURE_SCRIPT = """
    import importlib, importlib.abc, importlib.util, sys, types

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch.") or name == "hetcomm._C":
                raise ImportError(f"{name} was imported")

    package = types.ModuleType("hetcomm")
    package.__path__ = list(importlib.util.find_spec("hetcomm").submodule_search_locations)
    sys.modules["hetcomm"] = package
    sys.meta_path.insert(0, Refuse())
    for name in MODULES:
        importlib.import_module(name)
    print("ok")
"""


def test_planner_simulator_and_bench_cli_import_neither_torch_nor_the_extension() -> None:
    proc = _run(PURE_SCRIPT.replace("MODULES", repr(PURE_MODULES)))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# Put first on PYTHONPATH, it runs in every process of the run (the launcher and the ranks it
# spawns): it notes each process, and each import of the extension the moment it happens (the
# "import" audit event; registration reads hetcomm._build_info, not the extension).
RECORDER = """
import os, sys

_LOG = os.environ["HETCOMM_TEST_IMPORT_LOG"]


def _note(line):
    with open(_LOG, "a") as f:
        f.write(f"{os.getpid()} {line}\\n")


def _audit(event, args):
    if event == "import" and args[0] == "hetcomm._C":
        _note("imports hetcomm._C")


_note("started")
sys.addaudithook(_audit)
"""


def test_a_gloo_only_benchmark_never_loads_the_extension(tmp_path) -> None:
    (tmp_path / "sitecustomize.py").write_text(RECORDER)
    log = tmp_path / "imports.log"
    env = dict(os.environ, HETCOMM_TEST_IMPORT_LOG=str(log), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path)] + [p for p in sys.path if p]))
    proc = subprocess.run([sys.executable, "-m", "hetcomm.bench", "--backends", "gloo", "--nprocs", "2",
                           "--sizes", "1K", "--iters", "5", "--warmup", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = log.read_text().splitlines()
    started = {line.split()[0] for line in lines if line.endswith("started")}
    assert len(started) >= 3, f"the recorder ran in {len(started)} processes, expected the launcher and 2 ranks: {lines}"
    assert not [line for line in lines if "hetcomm._C" in line], lines


def _imported_names(path: str) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in the file names (``from a import b``:
    ``a`` and ``a.b``, since b may be a module), but those under ``if TYPE_CHECKING:``, which
    never run."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_only_the_engine_module_imports_the_extension() -> None:
    importers = sorted(os.path.relpath(path, PACKAGE)
                       for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)
                       if any(name == "hetcomm._C" or name.startswith("hetcomm._C.") for name in _imported_names(path)))
    assert importers == ["_engine.py"], importers


def test_the_codecs_do_not_use_torch_distributed() -> None:
    names = _imported_names(os.path.join(PACKAGE, "compress", "codecs.py"))
    assert not [name for name in names if name.startswith(("torch.distributed", "hetcomm"))], names
