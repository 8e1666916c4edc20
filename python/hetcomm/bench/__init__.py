"""``python -m hetcomm.bench``: nccl-tests style AllReduce benchmark of torch.distributed backends.

It measures ``allreduce(SUM)`` over a range of message sizes for each backend named in
``--backends`` (default ``hetcomm,gloo``) in one run, prints one table row per size with every
backend's ``time algbw busbw #wrong`` side by side and the busbw ratio hetcomm/gloo, and keeps the
numbers with the command that made them (``--json``).

``--sim-nic-mbit 800,800,800,100`` (or ``--sim-sites``/``--sim-link-mbit``) runs the same workers
on a simulated heterogeneous cluster instead (root), backends ``hetcomm,hetcomm-uniform,gloo``,
and shows beside each measurement the planner's prediction for the plan the group used and the
physical bound. ``--plot`` draws busbw against size.

Layout (each piece replaceable on its own; a simulated cluster or a plot is a new launcher or a
new reporter, not a change to the measurement):

``config``   command-line values -> a frozen, picklable :class:`~hetcomm.bench.config.BenchConfig`
``launch``   how ranks come to exist: N local processes, or one rank under torchrun (``env://``)
``worker``   what every rank does: control plane, one process group per backend, in turn
``measure``  one (backend, size) measurement: warm-up, agreed iteration count, timing, check
``results``  plain result records and the JSON document (no torch)
``report``   the table, the progress lines and the JSON file: its records and back (no torch)
``records``  result files as JSON Lines, one record per line with its command (no torch)
``sim_launch`` ``--sim-*``: a simulated heterogeneous cluster (hetcomm.sim, root) whose ranks each
             run this CLI as one env-mode rank
``analysis`` on a simulated cluster: physical link model, physical bound, the planner's
             prediction for the plan each group used (no torch)
``plot``     ``--plot``: busbw against size from the JSON document (matplotlib, Agg)

A gloo-only run never loads the compiled extension (``tests/test_imports.py`` checks every
process of one): ``hetcomm/__init__`` registers the backend without it, and the extension is
loaded only by the first hetcomm group. Workers import :mod:`hetcomm` only when ``hetcomm`` is
among the requested backends.
"""
