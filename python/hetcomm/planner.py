"""The planner's public names, as users have imported them (``hetcomm.planner.make_plan``,
``LinkModel``, ``Plan``, ...). The planner itself lives in the package `hetcomm.plan`, one module
per idea; this module only re-exports its public names.

Using a plan::

    from hetcomm.planner import LinkModel, make_plan
    plan = make_plan(LinkModel.from_nics([100e6, 100e6, 100e6, 12.5e6]), nbytes=64 << 20)
    hetcomm.set_plan(plan)
"""
from hetcomm.plan import *  # noqa: F401,F403  (the public names, listed in hetcomm.plan.__all__)
from hetcomm.plan import __all__  # noqa: F401
