"""hetcomm: collectives for data-parallel training on heterogeneous clusters.

``import hetcomm`` registers the torch.distributed backend ``"hetcomm"``::

    import hetcomm, torch.distributed as dist
    dist.init_process_group("hetcomm")
"""
from hetcomm._backend import (backend_of, get_plan, link_model, listen_address, probe, register_backend,
                              set_plan)

__version__ = "0.1.0"
__all__ = ["register_backend", "backend_of", "get_plan", "set_plan", "probe", "link_model", "listen_address",
           "__version__"]

register_backend()
