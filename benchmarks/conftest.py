"""Kernel micro-benchmarks (pytest-benchmark). Collected only when benchmarks were asked for:

    python -m pytest benchmarks --benchmark-only --benchmark-json benchmarks/results/reduce_kernels.json

A plain ``pytest`` (or ``pytest tests``) does not collect anything here.
"""
import pytest


def _benchmarks_requested(config) -> bool:
    try:
        return bool(config.getoption("benchmark_only") or config.getoption("benchmark_enable"))
    except ValueError:  # pytest-benchmark is not installed
        return False


def pytest_ignore_collect(collection_path, config):
    if collection_path.name.startswith("test_") and not _benchmarks_requested(config):
        return True
    return None


@pytest.fixture(scope="session")
def hetcomm_C():
    """The compiled extension; skips when it is missing or has no reduce_into (build it first:
    ``pip install --no-build-isolation -e .``)."""
    try:
        from hetcomm import _C
    except ImportError as e:
        pytest.skip(f"hetcomm._C is not importable: {e}")
    if not hasattr(_C, "reduce_into"):
        pytest.skip("hetcomm._C has no reduce_into binding")
    return _C
