"""DiLoCo / local SGD for unequal workers: local steps set by measured speed, sample-weighted outer update.

::

    diloco = hetcomm.DiLoCo(model, opt, local_steps="time", steps=50)   # opt: the inner optimizer
    for x, y in diloco.loop(loader, max_samples=1_000_000):  # stops every rank at the same round
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        diloco.step(samples=len(x), loss=loss.item())        # synchronises when the round is over

After each round (its length from `hetcomm.local_steps`) every rank reduces the weighted
pseudo-gradient (`hetcomm.compress`; over workers of several ranks, `hetcomm.train.workers`) and
takes one outer step; with ``overlap=True`` that runs on a background thread during the next
round. Every rank must construct the object with the same arguments and call `step` after every
inner step. The algorithm and the derivations of the weighting and the overlap:
docs/diloco.md#the-algorithm, docs/diloco.md#outer-weights, docs/diloco.md#overlap-the-derivation.

The package: `loop` (the class, its loop and bookkeeping), `agreement` (the round boundary's
agreement and reduction), `schedule` (fragments and the
overlap's moves), `stream` (staggered fragments), `shard` (the state split over a worker's
ranks, or a model's FSDP2 shards), `outer` (weights, the outer step), `table` (what the ranks agree
on, and what is decided from it), `results` (`stats`, `timeline`), `checkpoint`.
"""
from hetcomm.train.diloco.loop import DiLoCo
from hetcomm.train.diloco.outer import WEIGHTINGS, default_outer_optimizer, outer_weights
from hetcomm.train.diloco.table import last_round_seconds

__all__ = ["DiLoCo", "WEIGHTINGS", "outer_weights", "default_outer_optimizer", "last_round_seconds"]
