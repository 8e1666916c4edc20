"""Training on unequal ranks, built on the collectives of the rest of hetcomm.

* unequal devices: `hooks` (sample-weighted DDP hooks), `partition` (`split_batch`,
  `Partitioner`), `data` (`HeteroBatchSampler`), `adaptive` (`AdaptiveDataParallel`);
* DiLoCo: `local_steps` (fixed, by speed, by time), `workers` (workers of several ranks),
  `diloco` (`DiLoCo`, with `hetcomm.compress` for the outer synchronisation);
* fault-tolerant DiLoCo: `membership`, `elastic` (``DiLoCo(membership=Elastic(...))``: DiLoCo in
  generations; `ElasticDiLoCo`, a constructor of it); `flat`: parameters as one flat vector.

The public names are at the top level (`hetcomm.DiLoCo`), and ``hetcomm.hooks is
hetcomm.train.hooks`` (see ``hetcomm/__init__.py``). Dependencies go one way: data -> partition;
adaptive -> hooks, data, partition; diloco -> local_steps, workers, partition, flat,
hetcomm.compress; elastic -> membership, diloco, flat; workers -> hetcomm.compress.
"""
