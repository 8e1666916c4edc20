"""Result records of the benchmark and the JSON document built from them (no torch import).

Bandwidths follow nccl-tests: ``algbw = bytes / time`` and, for AllReduce,
``busbw = algbw * 2(n-1)/n``. The factor is the fraction of the buffer each rank must send
(and receive) in any bandwidth-optimal AllReduce -- ``(n-1)/n`` in the reduce-scatter and again
in the all-gather -- so busbw is comparable to the link bandwidth whatever the rank count.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

# The pair whose busbw ratio the report shows when both ran.
RATIO_NUMERATOR = "hetcomm"
RATIO_DENOMINATOR = "gloo"
# Speedups of hetcomm (time ratio other/hetcomm) reported when these ran beside it.
SPEEDUP_BASELINES = ("gloo", "hetcomm-uniform", "hetcomm-flat")


def allreduce_bus_factor(world_size: int) -> float:
    """``2(n-1)/n``: busbw / algbw for AllReduce (0 for a single rank, which moves nothing)."""
    return 2.0 * (world_size - 1) / world_size


@dataclass(frozen=True)
class SizeResult:
    """One (backend, size) measurement, already reduced over ranks."""

    backend: str
    size_bytes: int
    count: int
    dtype: str
    redop: str
    warmup: int
    iters: int                      # agreed by all ranks
    time_us: float                  # slowest rank's mean time per allreduce
    algbw_gbps: float
    busbw_gbps: float
    wrong: int                      # wrong elements summed over ranks
    rank_time_us: tuple[float, ...] # every rank's mean time, by rank (heterogeneity shows here)
    # hetcomm: how rank 0's timed allreduces moved their data (hetcomm.stats' collectives_by_path:
    # "tcp", "shm" for one host's shared memory, "hierarchical" for the host level); "" otherwise
    path: str = ""


@dataclass
class BenchReport:
    """Everything one run measured, plus what is needed to reproduce it."""

    argv: list[str]
    command: str
    launch: str                     # "local" or "env"
    world_size: int
    backends: list[str]
    dtype: str
    hostname: str
    torch_version: str
    python_version: str
    started_at: str
    config: dict[str, Any]
    results: list[SizeResult] = field(default_factory=list)
    finished_at: Optional[str] = None
    # Plan each backend's group used, recorded right after its creation (JSON-ready dicts:
    # backend, kind, source, order, shares, min_bytes, segment_bytes, text, model).
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Simulated cluster (hetcomm.bench.analysis.physical_model), None outside a simulation; with
    # it, analysis.annotate fills the predictions and bounds below.
    sim: Optional[dict[str, Any]] = None
    predicted_s: dict[str, dict[int, Optional[float]]] = field(default_factory=dict)
    bound_s: dict[int, Optional[float]] = field(default_factory=dict)

    @property
    def total_wrong(self) -> int:
        return sum(result.wrong for result in self.results)

    def sizes(self) -> list[int]:
        return sorted({result.size_bytes for result in self.results})

    def by_size(self) -> dict[int, dict[str, SizeResult]]:
        """``{size: {backend: result}}`` in ascending size, backends in run order."""
        table: dict[int, dict[str, SizeResult]] = {size: {} for size in self.sizes()}
        for result in self.results:
            table[result.size_bytes][result.backend] = result
        return table

    def has_ratio(self) -> bool:
        return RATIO_NUMERATOR in self.backends and RATIO_DENOMINATOR in self.backends

    def speedup_baselines(self) -> list[str]:
        """The baselines hetcomm's speedup is reported against (those that ran beside it)."""
        if RATIO_NUMERATOR not in self.backends:
            return []
        return [name for name in SPEEDUP_BASELINES if name in self.backends]

    def predicted(self, result: SizeResult) -> Optional[float]:
        return self.predicted_s.get(result.backend, {}).get(result.size_bytes)

    def pred_ratio(self, result: SizeResult) -> Optional[float]:
        """measured / predicted (1.0: the planner's model was exact)."""
        return _ratio(result.time_us * 1e-6, self.predicted(result))

    def bound(self, size_bytes: int) -> Optional[float]:
        return self.bound_s.get(size_bytes)

    def time_over_bound(self, result: SizeResult) -> Optional[float]:
        """measured / physical bound (>= 1; about 1.05 is TCP's header overhead alone)."""
        return _ratio(result.time_us * 1e-6, self.bound(result.size_bytes))

    def to_json(self) -> dict[str, Any]:
        rows = []
        ratios = []
        for size, per_backend in self.by_size().items():
            any_result = next(iter(per_backend.values()))
            row: dict[str, Any] = {
                "size_bytes": size,
                "count": any_result.count,
                "type": any_result.dtype,
                "redop": any_result.redop,
                "backends": {name: _result_json(r) for name, r in per_backend.items()},
            }
            if self.has_ratio():
                ratio = busbw_ratio(per_backend)
                row["busbw_ratio_hetcomm_gloo"] = ratio
                ratios.append({"size_bytes": size, "busbw_ratio_hetcomm_gloo": ratio})
            if self.sim is not None:
                row["bound_s"] = self.bound(size)
                for name, result in per_backend.items():
                    row["backends"][name].update({
                        "predicted_s": self.predicted(result),
                        "pred_ratio": self.pred_ratio(result),
                        "bound_s": self.bound(size),
                        "time_over_bound": self.time_over_bound(result)})
            for baseline in self.speedup_baselines():
                row[speedup_key(baseline)] = speedup(per_backend, baseline)
            rows.append(row)
        document = {
            "benchmark": "allreduce",
            "argv": self.argv,
            "command": self.command,
            "launch": self.launch,
            "nprocs": self.world_size,
            "backends": self.backends,
            "dtype": self.dtype,
            "hostname": self.hostname,
            "torch_version": self.torch_version,
            "python_version": self.python_version,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "config": self.config,
            "total_wrong": self.total_wrong,
            "rows": rows,
            "ratios": ratios,
        }
        if self.plans:
            document["plans"] = self.plans
        if self.sim is not None:
            document["sim"] = self.sim
        return document


def busbw_ratio(per_backend: dict[str, SizeResult],
                numerator: str = RATIO_NUMERATOR,
                denominator: str = RATIO_DENOMINATOR) -> Optional[float]:
    """busbw(numerator) / busbw(denominator); None if either is missing or the denominator is 0."""
    top, bottom = per_backend.get(numerator), per_backend.get(denominator)
    if top is None or bottom is None or bottom.busbw_gbps <= 0.0:
        return None
    return top.busbw_gbps / bottom.busbw_gbps


def speedup(per_backend: dict[str, SizeResult], baseline: str,
            subject: str = RATIO_NUMERATOR) -> Optional[float]:
    """time(baseline) / time(subject): how many times faster ``subject`` was; None if missing."""
    top, bottom = per_backend.get(baseline), per_backend.get(subject)
    if top is None or bottom is None:
        return None
    return _ratio(top.time_us, bottom.time_us)


def speedup_key(baseline: str) -> str:
    """JSON key of hetcomm's speedup over ``baseline``: speedup_hetcomm_over_gloo, ..._uniform."""
    short = baseline.replace("hetcomm-", "")
    return f"speedup_{RATIO_NUMERATOR}_over_{short}"


def _ratio(top: Optional[float], bottom: Optional[float]) -> Optional[float]:
    if top is None or bottom is None or not bottom > 0.0:
        return None
    return top / bottom


def _result_json(result: SizeResult) -> dict[str, Any]:
    data = asdict(result)
    data["rank_time_us"] = list(result.rank_time_us)
    for key in ("size_bytes", "count", "dtype", "redop", "backend"):
        data.pop(key)           # carried once by the row
    return data


def average_busbw(results: Sequence[SizeResult]) -> float:
    """Mean busbw over sizes, as nccl-tests' "Avg bus bandwidth" footer."""
    return sum(r.busbw_gbps for r in results) / len(results) if results else 0.0
