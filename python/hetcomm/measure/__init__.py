"""Measuring a group's links for the planner: what to measure (`schedule`, pure), running a round
of concurrent flows (`rounds`), the probes built from them (`probe`: by levels, or every pair),
what each rank measures alone (`local`), and links the user declares (`declared`)."""
from hetcomm.measure.declared import model_from_declared, parse_mbit
from hetcomm.measure.local import measure_alpha, measure_reduce_bps
from hetcomm.measure.probe import ProbeResult, measure_levels, measure_model, measure_pairs

__all__ = ["model_from_declared", "parse_mbit", "measure_alpha", "measure_reduce_bps", "ProbeResult",
           "measure_levels", "measure_pairs", "measure_model"]
