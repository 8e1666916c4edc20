"""``--plot PATH.png``: bus bandwidth against message size, one line per backend.

Drawn from the JSON document of a run (:meth:`hetcomm.bench.results.BenchReport.to_json`), so a
saved result can be plotted again later: ``python -m hetcomm.bench.plot RESULT.json OUT.png``
(the document is rebuilt from the file's records, :func:`hetcomm.bench.report.read_report`; an
older single-document file works too).

* measured busbw: a solid line with markers per backend, labelled with the plan its group used;
* the planner's prediction (simulated clusters): the same colour, dotted;
* the physical bound (simulated clusters): a dashed black line at busbw = rate * 2(n-1)/n (the
  bound is N / rate, the same busbw at every size);
* x: message size, log scale; y: busbw in GB/s (MB/s when everything is below 1 GB/s), log
  scale when the values span more than 20x; title: the cluster.

matplotlib is optional (only ``--plot`` needs it) and runs with the Agg backend (no display).
"""
from __future__ import annotations

import sys
import textwrap
from typing import Any, Optional, Sequence

from hetcomm.bench.report import read_report
from hetcomm.bench.results import allreduce_bus_factor

INSTALL_HINT = "pip install matplotlib"


class PlotError(RuntimeError):
    """The plot could not be made (the message says why)."""


def require_matplotlib() -> None:
    """Raises PlotError naming the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise PlotError(f"--plot needs matplotlib, which is not installed ({error}): "
                        f"{INSTALL_HINT}") from None


def size_label(size: float) -> str:
    """``16777216`` -> ``16M``; binary units, as the CLI reads sizes."""
    size = int(size)
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return f"{size}"


def plan_label(record: Optional[dict[str, Any]]) -> str:
    """A short description of a plan record: ``ring 0>1>2>3, shares 0/0/0/100%``."""
    if not record:
        return ""
    shares = record.get("shares") or []
    total = sum(shares) or 1.0
    uniform = len(set(shares)) <= 1
    ring = ">".join(str(r) for r in record.get("order", []))
    if record.get("kind") != "hetcomm":
        return f"uniform ring {ring}"
    if uniform:
        text = f"ring {ring}, uniform shares"
    else:
        text = f"ring {ring}, shares " + "/".join(f"{100.0 * s / total:.0f}" for s in shares) + "%"
    if record.get("min_bytes"):
        text += f" from {size_label(record['min_bytes'])}"
    sites = record.get("sites")
    if sites:
        groups = " ".join("{" + ",".join(map(str, site)) + "}" for site in sites["sites"])
        text = f"site plan {groups} from {size_label(int(sites.get('min_bytes') or 0))}; below: {text}"
    return text


def series(document: dict[str, Any]) -> dict[str, Any]:
    """The plotted numbers, in bytes and GB/s: ``{"measured": {backend: [(size, busbw)]},
    "predicted": {backend: [(size, busbw)]}, "bound": [(size, busbw)]}``."""
    factor = allreduce_bus_factor(int(document["nprocs"]))
    measured: dict[str, list[tuple[int, float]]] = {name: [] for name in document["backends"]}
    predicted: dict[str, list[tuple[int, float]]] = {name: [] for name in document["backends"]}
    bound: list[tuple[int, float]] = []
    for row in document["rows"]:
        size = int(row["size_bytes"])
        for name, result in row["backends"].items():
            measured.setdefault(name, []).append((size, float(result["busbw_gbps"])))
            if result.get("predicted_s"):
                predicted.setdefault(name, []).append(
                    (size, size / result["predicted_s"] * factor / 1e9))
        if row.get("bound_s"):
            bound.append((size, size / row["bound_s"] * factor / 1e9))
    return {"measured": measured, "predicted": predicted, "bound": bound}


def title(document: dict[str, Any]) -> str:
    sim = document.get("sim")
    where = (f"simulated cluster: {sim['description']}" if sim else
             f"{document['nprocs']} local ranks ({document.get('launch', '?')} launch)")
    head = f"allreduce {document.get('dtype', '')} sum, {where}"
    return "\n".join(textwrap.wrap(head, 80))


def write_plot(document: dict[str, Any], path: str) -> None:
    """Draws the busbw-vs-size plot of a run's JSON document into ``path`` (PNG)."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    data = series(document)
    values = [b for points in data["measured"].values() for _, b in points]
    values += [b for points in data["predicted"].values() for _, b in points]
    values += [b for _, b in data["bound"]]
    values = [v for v in values if v > 0]
    if not values:
        raise PlotError("nothing to plot: the run has no measurement")
    scale, unit = (1e3, "MB/s") if max(values) < 1.0 else (1.0, "GB/s")
    plans = document.get("plans", {})

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    sizes: set[int] = set()
    for index, (name, points) in enumerate(data["measured"].items()):
        if not points:
            continue
        color = colors[index % len(colors)]
        xs, ys = zip(*points)
        sizes.update(xs)
        label = name
        plan = plan_label(plans.get(name))
        if plan:
            label += f" ({plan})"
        ax.plot(xs, [y * scale for y in ys], marker="o", color=color, linewidth=2, label=label)
        predicted = data["predicted"].get(name)
        if predicted:
            pxs, pys = zip(*predicted)
            ax.plot(pxs, [y * scale for y in pys], linestyle=":", marker="x", color=color,
                    linewidth=1.5, label=f"{name}: planner's prediction")
    if data["bound"]:
        # bound_s = N / rate, so the bound is one busbw for every size: a horizontal line.
        bound = max(y for _, y in data["bound"]) * scale
        sim = document.get("sim") or {}
        which = {"nic": "N through the slowest NIC",
                 "hosts": "2(H-1) N through the hosts' NICs",
                 "sites": "2(S-1) N through the sites' cuts"}.get(sim.get("bound_kind"),
                                                                 "N through the narrowest cut")
        ax.axhline(bound, linestyle="--", color="black", linewidth=1.5,
                   label=f"physical bound: {which} ({bound:.3g} {unit} busbw)")

    ax.set_xscale("log", base=2)
    ordered = sorted(sizes)
    if len(ordered) <= 12:
        ax.xaxis.set_major_locator(FixedLocator(ordered))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: size_label(x)))
    ax.xaxis.set_minor_locator(NullLocator())
    if len(ordered) == 1:
        ax.set_xlim(ordered[0] / 2, ordered[0] * 2)
    elif ordered:
        ax.set_xlim(ordered[0] / 1.5, ordered[-1] * 1.5)
    if max(values) / min(values) > 20:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, max(values) * scale * 1.15)
    ax.set_xlabel("message size (bytes, binary units)")
    ax.set_ylabel(f"bus bandwidth ({unit}) = algbw * 2(n-1)/n")
    ax.set_title(title(document), fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as error:
        raise PlotError(f"cannot write {path}: {error}") from None
    finally:
        plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m hetcomm.bench.plot RESULT.json OUT.png", file=sys.stderr)
        return 2
    try:
        write_plot(read_report(argv[0]), argv[1])
    except (OSError, ValueError, KeyError, PlotError) as error:
        print(f"hetcomm.bench.plot: {error}", file=sys.stderr)
        return 2
    print(f"hetcomm.bench.plot: wrote {argv[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
