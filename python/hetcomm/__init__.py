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
import sys as _sys

from hetcomm._backend import (backend_of, get_plan, link_model, listen_address, monitored_barrier, probe,
                              register_backend, set_plan, stats, supported_devices, tls_available)
# What creating a group runs (hosts, the probe, the planner but its LP solver), loaded with the
# package: otherwise every rank imports it inside init_process_group, at once, and 32 ranks on
# two cores took seconds there.
from hetcomm import topology as _topology  # noqa: E402,F401
from hetcomm import compress  # noqa: E402  (public submodule)
from hetcomm.train import adaptive, data, diloco, hooks, local_steps, partition
from hetcomm.train.adaptive import AdaptiveDataParallel
from hetcomm.train.diloco import DiLoCo
from hetcomm.train.elastic import ElasticDiLoCo, StoreUnreachable

# The training modules live in hetcomm.train and keep their old names: hetcomm.hooks is
# hetcomm.train.hooks (likewise partition, data, adaptive, diloco, local_steps), so
# `import hetcomm.hooks`, `from hetcomm.diloco import DiLoCo` and pickles naming them still work.
for _m in (adaptive, data, diloco, hooks, local_steps, partition):
    _sys.modules["hetcomm." + _m.__name__.rpartition(".")[2]] = _m
del _m
# Likewise the planner's former modules: hetcomm.sites is hetcomm.plan.levels (site detection),
# hetcomm.site_planner is hetcomm.plan (site and host plans, the cut bound; cut_capacity now takes
# a LinkModel and a cut).
from hetcomm import plan as _plan  # noqa: E402
sites, site_planner = _plan.levels, _plan
_sys.modules["hetcomm.sites"], _sys.modules["hetcomm.site_planner"] = sites, site_planner



__version__ = "0.1.0"
__all__ = ["register_backend", "backend_of", "get_plan", "set_plan", "probe", "link_model", "listen_address",
           "supported_devices", "monitored_barrier", "stats", "tls_available",
           "AdaptiveDataParallel", "DiLoCo", "ElasticDiLoCo", "StoreUnreachable", "compress", "data", "hooks", "local_steps", "partition", "__version__"]

register_backend()
