"""Training on unequal ranks, built on the collectives of the rest of hetcomm.

* `hooks`: DDP communication hooks that weight each rank's gradient by the samples it processed.
* `partition`: splits a global batch in proportion to measured speeds (`split_batch`), and agrees
  on re-partitions online (`Partitioner`).
* `data`: `HeteroBatchSampler`, the per-rank slices of each global batch for a partition.
* `adaptive`: `AdaptiveDataParallel` = DDP + `hooks` + `partition` + `data`, re-partitioned from
  timed steps.
* `local_steps`: how many local steps each rank takes per DiLoCo round (fixed, by speed, by time).
* `workers`: DiLoCo workers of several ranks (a site): their process groups, the table per worker
  and the outer reduction spread over a worker's ranks.
* `diloco`: `DiLoCo` = `local_steps` + `workers` + the compressed all-reduce of
  `hetcomm.compress` (its codecs and the collective, a package at the top level) for the outer
  synchronisation.
* `membership`, `elastic`: `ElasticDiLoCo`, DiLoCo over workers that die and come back
  (heartbeats, liveness connections and compare-and-set decisions on an outside store); `flat`:
  parameters as one flat vector, for both.

The public names are at the top level (`hetcomm.AdaptiveDataParallel`, `hetcomm.DiLoCo`) and the
modules keep their old names as well: ``hetcomm.hooks is hetcomm.train.hooks`` (see
``hetcomm/__init__.py``). Dependencies go one way: data -> partition; adaptive -> hooks, data,
partition; diloco -> local_steps, workers, partition, flat, hetcomm.compress; elastic -> membership, diloco, flat; workers -> hetcomm.compress.
"""
