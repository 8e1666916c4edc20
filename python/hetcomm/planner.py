"""The planner's public names, as users have imported them (``hetcomm.planner.make_plan``,
``LinkModel``, ``Plan``, ...). The planner itself lives in the package `hetcomm.plan`, one module
per idea; this module only forwards its public names (on first use, so that the engine settings
among them are asked from the engine only when read).

Using a plan::

    from hetcomm.planner import LinkModel, make_plan
    plan = make_plan(LinkModel.from_nics([100e6, 100e6, 100e6, 12.5e6]), nbytes=64 << 20)
    hetcomm.set_plan(plan)
"""
from hetcomm import plan as _plan
from hetcomm.plan import __all__  # noqa: F401  (the public names)


def __getattr__(name: str):
    if name in __all__:
        return getattr(_plan, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
