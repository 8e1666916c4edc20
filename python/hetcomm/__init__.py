"""hetcomm: collectives for data-parallel training on heterogeneous clusters.

``import hetcomm`` registers the torch.distributed backend ``"hetcomm"``::

    import hetcomm, torch.distributed as dist
    dist.init_process_group("hetcomm")

For unequal ranks in data-parallel training: `hetcomm.AdaptiveDataParallel` (per-rank batches
proportional to measured speed, sample-weighted gradients), built from `hetcomm.partition`,
`hetcomm.data` and `hetcomm.hooks`. For geo-distributed training: `hetcomm.DiLoCo` (local steps set
by measured speed, sample-weighted outer update, compressed and overlapped synchronisation), built
from `hetcomm.local_steps` and `hetcomm.compress`; `hetcomm.stats` shows what crossed each link.
"""
from hetcomm._backend import (backend_of, get_plan, link_model, listen_address, monitored_barrier, probe,
                              register_backend, set_plan, stats, supported_devices)
from hetcomm import compress, data, hooks, local_steps, partition  # noqa: E402  (public submodules)
from hetcomm.adaptive import AdaptiveDataParallel
from hetcomm.diloco import DiLoCo

__version__ = "0.1.0"
__all__ = ["register_backend", "backend_of", "get_plan", "set_plan", "probe", "link_model", "listen_address",
           "supported_devices", "monitored_barrier", "stats",
           "AdaptiveDataParallel", "DiLoCo", "compress", "data", "hooks", "local_steps", "partition", "__version__"]

register_backend()
