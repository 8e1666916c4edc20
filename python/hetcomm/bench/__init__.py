"""``python -m hetcomm.bench``: nccl-tests style AllReduce benchmark of torch.distributed backends.

It measures ``allreduce(SUM)`` over a range of message sizes for each backend named in
``--backends`` (default ``hetcomm,gloo``) in one run, prints one table row per size with every
backend's ``time algbw busbw #wrong`` side by side and the busbw ratio hetcomm/gloo, and keeps the
numbers with the command that made them (``--json``).

Layout (each piece replaceable on its own; a simulated cluster or a plot is a new launcher or a
new reporter, not a change to the measurement):

``config``   command-line values -> a frozen, picklable :class:`~hetcomm.bench.config.BenchConfig`
``launch``   how ranks come to exist: N local processes, or one rank under torchrun (``env://``)
``worker``   what every rank does: control plane, one process group per backend, in turn
``measure``  one (backend, size) measurement: warm-up, agreed iteration count, timing, check
``results``  plain result records and the JSON document (no torch)
``report``   the table, the progress lines and the JSON file (no torch)

Nothing here imports :mod:`hetcomm` itself at module level: ``hetcomm/__init__`` loads the
compiled extension, and a gloo-only run must work without it. Workers import it only when
``hetcomm`` is among the requested backends.
"""
