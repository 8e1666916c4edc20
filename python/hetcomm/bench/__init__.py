"""``python -m hetcomm.bench``: nccl-tests style AllReduce benchmark of torch.distributed backends.

It measures ``allreduce(SUM)`` over a range of message sizes for each backend of ``--backends``
(default ``hetcomm,gloo``) in one run, prints ``time algbw busbw #wrong`` per size and backend,
and keeps the numbers with the command that made them (``--json``). ``--sim-nic-mbit`` (or
``--sim-sites``, ...) runs the same workers on a simulated cluster and adds the planner's
prediction and the physical bound. The pieces: `config`, `launch`, `worker`, `measure`,
`results`, `report`, `records`, `sim_launch`, `analysis`, `plot`. A gloo-only run never loads
the compiled extension.

How it measures, launches and judges: docs/bench-cli.md.
"""
