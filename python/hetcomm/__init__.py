"""hetcomm: collectives for data-parallel training on heterogeneous clusters.

``import hetcomm`` registers the torch.distributed backend ``"hetcomm"``::

    import hetcomm, torch.distributed as dist
    dist.init_process_group("hetcomm")

For unequal ranks: `hetcomm.AdaptiveDataParallel` (built from `hetcomm.partition`, `hetcomm.data`,
`hetcomm.hooks`). Across sites: `hetcomm.DiLoCo` (from `hetcomm.local_steps`, `hetcomm.compress`)
and `hetcomm.ElasticDiLoCo`. `hetcomm.stats` shows what crossed each link. The import itself is
light: the compiled extension and what group creation runs (hosts, probe, planner) load with the
first hetcomm group, the training classes and the other submodules on first use (``hetcomm.DiLoCo``
imports `hetcomm.train.diloco` then). Documentation: README.md and docs/.
"""
import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import sys as _sys

from hetcomm._backend import (backend_of, get_plan, link_model, listen_address, monitored_barrier, probe,
                              register_backend, set_plan, staging_host_bytes, stats, supported_devices,
                              tls_available)

__version__ = "0.1.0"
__all__ = ["register_backend", "backend_of", "get_plan", "set_plan", "probe", "link_model", "listen_address",
           "supported_devices", "monitored_barrier", "stats", "staging_host_bytes", "tls_available",
           "AdaptiveDataParallel", "DiLoCo", "Elastic", "ElasticDiLoCo", "StoreUnreachable", "compress", "data", "hooks",
           "local_steps", "partition", "__version__"]

# Names loaded on first use: attribute -> (module, name in it).
_LAZY_NAMES = {
    "AdaptiveDataParallel": ("hetcomm.train.adaptive", "AdaptiveDataParallel"),
    "DiLoCo": ("hetcomm.train.diloco", "DiLoCo"),
    "Elastic": ("hetcomm.train.elastic", "Elastic"),
    "ElasticDiLoCo": ("hetcomm.train.elastic", "ElasticDiLoCo"),
    "StoreUnreachable": ("hetcomm.train.membership", "StoreUnreachable"),
}
_SUBMODULES = ("bench", "compress", "hosts", "labels", "measure", "plan", "planner", "rates", "sim", "store",
               "tls_certs", "topology", "train")
# Former names of modules that moved, kept for users' imports and for pickles naming them: the
# training modules now live in hetcomm.train (hetcomm.hooks is hetcomm.train.hooks); hetcomm.sites
# is hetcomm.plan.levels (site detection) and hetcomm.site_planner is hetcomm.plan (site and host
# plans, the cut bound; cut_capacity now takes a LinkModel and a cut).
_FORMER_NAMES = {
    **{f"hetcomm.{name}": f"hetcomm.train.{name}"
       for name in ("adaptive", "data", "diloco", "hooks", "local_steps", "partition")},
    "hetcomm.sites": "hetcomm.plan.levels",
    "hetcomm.site_planner": "hetcomm.plan",
}


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        module, attribute = _LAZY_NAMES[name]
        value = getattr(_importlib.import_module(module), attribute)
    elif name in _SUBMODULES:
        value = _importlib.import_module(f"{__name__}.{name}")
    elif f"{__name__}.{name}" in _FORMER_NAMES:
        value = _importlib.import_module(f"{__name__}.{name}")      # the module under its former name
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    former = (name.rpartition(".")[2] for name in _FORMER_NAMES)
    return sorted(set(globals()) | set(_LAZY_NAMES) | set(_SUBMODULES) | set(former))


class _FormerNames(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """``import hetcomm.hooks`` (and unpickling ``hetcomm.diloco.X``) gives the module itself,
    imported when first asked for: the module put in ``sys.modules`` under the former name is
    the very object of its new name, so classes and pickles are the same either way."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _FORMER_NAMES:
            return None
        return _importlib_util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None        # a placeholder, replaced in exec_module

    def exec_module(self, module) -> None:
        # A module may replace itself in sys.modules; the import system returns the replacement.
        _sys.modules[module.__name__] = _importlib.import_module(_FORMER_NAMES[module.__name__])


# First on the path, so that a stale file under a former name (build/lib keeps them, a copied
# tree may) cannot shadow the module it stands for; once, even on reload.
if not any(type(finder).__name__ == "_FormerNames" for finder in _sys.meta_path):
    _sys.meta_path.insert(0, _FormerNames())

register_backend()
