"""Fault-tolerant DiLoCo: dead workers are dropped, restarted ones rejoin, new ones join while it runs.

::

    python -m hetcomm.store --port 29400                    # once, on a machine that runs no worker
    membership = hetcomm.Elastic(store="STORE_HOST:29400", worker_id="w3", job="run7")
    diloco = hetcomm.DiLoCo(model, opt, membership=membership, steps=50, **options)   # every worker;
    for x, y in diloco.loop(loader, max_rounds=1000):                                 # restart alike
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        diloco.step(samples=len(x), loss=loss.item())

The run is a sequence of generations, each a `DiLoCo` over the members of the time, with every
DiLoCo feature (`run`, `ElasticRun`). Membership changes between generations, through epochs
on the store: arrive, decide (compare_set), form the group, send the state to the members
without it, then commit or abort (membership on the store: `hetcomm.train.membership`). The
protocol: docs/elastic-protocol.md#an-epoch-step-by-step; behaviour: docs/elastic.md.
``hetcomm.ElasticDiLoCo(model, opt, store=..., steps=...)`` is the same with the arguments of
the class that came before (`thin`).

The package: `run` (DiLoCo in generations, with `run_epochs` its epoch hooks, `carry` the round
a generation ended inside of, `handover` the state sent to joiners in a generation's background,
`sharded` and `reshard` the state when it is sharded over a worker's ranks, `watchdog`, `phases`
what a change of generation cost, `checkpoint`), `loop` (the membership side: construction,
admission, the training loop's side), `epochs` (admission and each epoch), `eras`, `joins`,
`generation` (the members' group, the state transfer and the epoch's table), `options`,
`common`.
"""
from hetcomm.train.elastic.options import Elastic
from hetcomm.train.elastic.run import ElasticRun
from hetcomm.train.elastic.thin import ElasticDiLoCo
from hetcomm.train.membership import StoreUnreachable

__all__ = ["Elastic", "ElasticDiLoCo", "ElasticRun", "StoreUnreachable"]
