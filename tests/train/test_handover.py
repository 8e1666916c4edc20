"""The run's state for a joiner when the epoch deferred it (`hetcomm.train.elastic.handover`), on
two ranks of one group: rank 0 holds the state (its round, samples, history and an outer
optimizer with momentum), rank 1 has just been admitted without it.

* `agree_on_stop`: the joiner does not know the run's samples and outer steps; both ranks take
  the holder's and stop alike (a budget reached, or the run's end that only one of them read on the store).
* `send_now`: when the run ends there, the joiner still ends with the holder's global parameters,
  outer optimizer state, round and history, and holds the state.
* A state of another round than the decision names is refused (ValueError on the joiner).
"""
from __future__ import annotations

import torch

from harness import run_ranks
from marks import hetcomm_only

ROUND, SAMPLES = 5, 100


class _Keys:
    """The run's records on the store, as far as the handover reads them."""

    def __init__(self, ended: bool = False) -> None:
        self.values = {"ended": {"round": ROUND, "reason": "max_rounds"}} if ended else {}

    def peek(self, key):
        return self.values.get(key)

    def first(self, key, value):
        return self.values.setdefault(key, value)


def _run(rank: int, budget: int, ended: bool = False):
    from hetcomm.train.elastic.generation import Generation
    from hetcomm.train.elastic.loop import ElasticBase
    from hetcomm.train.elastic.phases import Phases
    from hetcomm.train.flat import FlatParameters

    class Run(Generation, FlatParameters):
        _check_budgets = ElasticBase._check_budgets

        def _log(self, line: str) -> None:
            self.lines.append(line)

    holder = rank == 0
    run = Run()
    torch.manual_seed(10 + rank)                     # the joiner's fresh model differs
    run.model = torch.nn.Linear(4, 3)
    run._params, run._master = list(run.model.parameters()), torch.float32
    run._global = [p.detach().clone() for p in run._params]
    run.outer_optimizer = torch.optim.SGD(run._global, lr=0.7, momentum=0.9, nesterov=True)
    if holder:                                       # momentum: state the joiner must receive
        for g in run._global:
            g.grad = torch.linspace(-1, 1, g.numel()).view(g.shape)
        run.outer_optimizer.step()
        run.outer_optimizer.zero_grad(set_to_none=True)
    run._round = ROUND
    run._samples_total, run._applied_total = (SAMPLES, ROUND) if holder else (0, 0)
    run._history = [{"round": r} for r in range(1, ROUND + 1)] if holder else []
    run._events, run.lines = [], []
    run._codec_name, run.worker_id, run._me = "compress='fp32', block=2048", f"w{rank}", f"w{rank}#0000000{rank}"
    run._holds, run._stopped, run._stop_reason = holder, False, None
    run._budgets = {"max_rounds": 0, "max_samples": budget}
    run._keys, run._phases = _Keys(ended), Phases()
    return run


def _deferred(run, round_: int = ROUND) -> None:
    """What the epoch leaves behind: the decision, and the holders' fingerprint from its table."""
    from hetcomm.train.elastic.common import _fingerprint
    from hetcomm.train.partition import exchange_columns

    run._state_deferred = {"members": ["w0#00000000", "w1#00000001"], "holders": ["w0#00000000"],
                           "joined": ["w1#00000001"], "round": round_}
    table = exchange_columns([float(_fingerprint(run._flatten_global())) if run._holds else 0.0])
    run._holders_print = table[0][0]


def handover_cases(rank: int, world_size: int) -> dict:
    from hetcomm.train.elastic import handover

    out = {}
    # the run goes on: nobody stops, the joiner takes the run's samples
    run = _run(rank, budget=10 * SAMPLES)
    _deferred(run)
    handover.agree_on_stop(run)
    out["goes on"] = (run._stopped, run._samples_total, run._applied_total)
    # the budget is reached: both stop, and the joiner gets the state at once
    run = _run(rank, budget=SAMPLES)
    _deferred(run)
    handover.agree_on_stop(run)
    stopped = run._stopped
    handover.send_now(run)
    momentum = [run.outer_optimizer.state[g]["momentum_buffer"].tolist() for g in run._global]
    out["budget"] = {"stopped": stopped, "samples": run._samples_total, "holds": run._holds,
                     "round": run._round, "history": len(run._history), "lines": run.lines,
                     "global": [g.tolist() for g in run._global], "model": [p.tolist() for p in run._params],
                     "momentum": momentum, "deferred": run._state_deferred}
    # only the joiner read the run's end on the store: both stop
    run = _run(rank, budget=10 * SAMPLES, ended=rank == 1)
    _deferred(run)
    handover.agree_on_stop(run)
    out["ended"] = (run._stopped, run._stop_reason)
    # a state of another round than the decision's
    run = _run(rank, budget=SAMPLES)
    _deferred(run, round_=ROUND + 1)
    try:
        handover.send_now(run)
        out["round"] = None
    except ValueError as e:
        out["round"] = str(e)
    return out


@hetcomm_only("the elastic run's groups are hetcomm's here")
def test_a_deferred_state_reaches_the_joiner_when_the_run_ends_and_both_stop_alike() -> None:
    holder, joiner = run_ranks(2, handover_cases, timeout=120)
    assert holder["goes on"] == joiner["goes on"] == (False, SAMPLES, ROUND)
    h, j = holder["budget"], joiner["budget"]
    assert h["stopped"] and j["stopped"] and h["samples"] == j["samples"] == SAMPLES
    assert j["holds"] and j["round"] == ROUND and j["history"] == ROUND and j["deferred"] is None
    assert j["global"] == h["global"] and j["model"] == h["global"] and j["momentum"] == h["momentum"]
    assert any("the run ended as this worker joined" in line for line in j["lines"]), j["lines"]
    assert holder["ended"][0] and joiner["ended"][0], (holder["ended"], joiner["ended"])
    assert holder["round"] is None
    assert joiner["round"] and "the holders sent the state of round 5" in joiner["round"], joiner["round"]
