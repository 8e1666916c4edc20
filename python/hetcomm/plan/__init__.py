"""hetcomm's planner: which schedule an AllReduce runs, from what is known about the links.

Data flows one way, probe -> model -> plan -> backend, and nothing here imports torch. One room
per idea, each importing only the rooms above it: `model` (`LinkModel`), `levels` (`Topology`:
hosts and sites), `schedules` (`Plan`, `SitePlan`), `cost` (predicted times, the cut bound),
`shares` (two LPs for one ring order), `order` (the ring order), `hierarchy` (site and host
schedules), `choose` (the plan a group installs, per message size).

`hetcomm.planner` keeps the public names of the earlier single-module planner. The derivations:
docs/planner.md#the-cost-model and docs/hosts-and-sites.md#the-site-schedules-cost-model.
"""
from hetcomm.plan.choose import (DECLARED_MIN_GAIN, MEASURED_MIN_GAIN, choose_plan, format_plan,
                                 hierarchical_enabled, plan_for_group, segment_bytes_for, snap_measured, with_host_plan)
from hetcomm.plan.cost import (cut_bound_seconds, cut_capacity, predict_allreduce_seconds, predict_site_plan_seconds,
                               ring_seconds_per_byte, site_cuts, site_plan_seconds_per_byte, uplink_seconds_per_byte)
from hetcomm.plan.hierarchy import best_site_plan, host_plan, site_shares_for, three_level_plan
from hetcomm.plan.levels import Topology, detect_sites, parse_sites, topology_from
from hetcomm.plan import model as _model
from hetcomm.plan.model import DEFAULT_ALPHA_SECONDS, LinkModel
from hetcomm.plan.order import (DEFAULT_MIN_GAIN, MAX_EXHAUSTIVE_RANKS, ORDER_TIE_RTOL, best_plan, crossover_bytes,
                                make_plan, uniform_plan)
from hetcomm.plan.schedules import Plan, SitePlan, shares_to_counts
from hetcomm.plan.shares import SHARE_QUANTUM, SHARE_TIE_RTOL, PlanningError, solve_shares

__all__ = [
    "LinkModel", "Topology", "Plan", "SitePlan", "PlanningError",
    "solve_shares", "best_plan", "uniform_plan", "make_plan", "crossover_bytes", "choose_plan",
    "plan_for_group", "best_site_plan", "host_plan", "three_level_plan", "site_shares_for", "with_host_plan", "snap_measured",
    "predict_allreduce_seconds", "predict_site_plan_seconds", "ring_seconds_per_byte", "site_plan_seconds_per_byte",
    "uplink_seconds_per_byte", "cut_capacity", "cut_bound_seconds", "site_cuts",
    "detect_sites", "parse_sites", "topology_from", "shares_to_counts", "format_plan", "segment_bytes_for",
    "hierarchical_enabled", "SMALL_ALLREDUCE_BYTES", "SEGMENT_BYTES", "MIN_SEGMENT_BYTES", "MAX_SEGMENT_BYTES",
    "DEFAULT_ALPHA_SECONDS", "DEFAULT_MIN_GAIN", "DECLARED_MIN_GAIN", "MEASURED_MIN_GAIN", "MAX_EXHAUSTIVE_RANKS",
    "ORDER_TIE_RTOL", "SHARE_TIE_RTOL", "SHARE_QUANTUM",
]


def __getattr__(name: str):
    # SMALL_ALLREDUCE_BYTES, SEGMENT_BYTES, MIN_SEGMENT_BYTES, MAX_SEGMENT_BYTES: the engine's,
    # asked from it on first use (hetcomm.plan.model), so that importing the planner loads nothing.
    if name in _model._ENGINE_ATTRIBUTES:
        return getattr(_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_model._ENGINE_ATTRIBUTES))
