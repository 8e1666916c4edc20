"""Fault-tolerant DiLoCo: dead workers are dropped at the round, restarted ones rejoin, nothing is lost.

::

    python -m hetcomm.store --port 29400                    # once, on a machine that runs no worker
    diloco = hetcomm.ElasticDiLoCo(model, opt, store="STORE_HOST:29400", worker_id="w3", job="run7",
                                   steps=50)                 # every worker; restart with the same command
    for x, y in diloco.loop(loader, max_rounds=1000):
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        diloco.step(samples=len(x), loss=loss.item())

Membership changes only at a round's synchronisation. Every attempt (an *epoch*) goes arrive,
decide (compare_set on the store), admit, reduce, then commit or abort, so a round either
completes on every member or is redone (membership on the store: `hetcomm.train.membership`).
The protocol: docs/elastic.md#a-synchronisation-attempt-step-by-step; behaviour: docs/elastic.md.

``hetcomm.DiLoCo(..., membership=hetcomm.Elastic(store=...))`` runs the same protocol between
generations of a `DiLoCo` instead of at every round, so that every DiLoCo feature is there
(`run`, `ElasticRun`).

The package: `loop` (the class and the training loop's side), `run` (DiLoCo in generations, with
`run_epochs` its epoch hooks, `carry` the round a generation ended inside of, `handover` the
state sent to joiners in a generation's background, `phases` what a change of generation cost,
`checkpoint`), `epochs` (admission and each synchronisation attempt), `eras`, `joins`, `early`
(joining inside a round through offers on the store), `generation` (the members' group, state
transfer, reduction and update), `common`.
"""
from hetcomm.train.elastic.loop import ElasticDiLoCo
from hetcomm.train.elastic.options import Elastic
from hetcomm.train.elastic.run import ElasticRun
from hetcomm.train.membership import StoreUnreachable

__all__ = ["Elastic", "ElasticDiLoCo", "ElasticRun", "StoreUnreachable"]
