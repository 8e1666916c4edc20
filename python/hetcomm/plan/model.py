"""What the planner knows about a group: `LinkModel`, its links, reducers and shared links by level.

A model holds, for P ranks, the directed link rates ``bw[i][j]`` (bytes/s), every rank's reduce
throughput, a per-message latency and the links that several ranks share (``uplinks``). Shared
links are *levels*: a host's NIC is shared by the host's ranks, a site's WAN uplink by the site's
hosts. A level is a group of ranks with an out-rate (everything its ranks send to ranks outside
it) and an in-rate; groups are *laminar* (any two are disjoint or one holds the other), which is
exactly host inside site inside the world. `LinkModel.from_levels` builds a model from rates per
level, as the probe measures them (`hetcomm.measure`).

Pure: numpy only, no torch. The rate matrix is a read-only ``numpy`` array, so that models of a
thousand ranks are built, compared and restricted in milliseconds; ``bw[i][j]`` reads as before.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from hetcomm import _engine

# The engine's own settings, as this process's engine uses them (HETCOMM_SMALL_ALLREDUCE_BYTES and
# HETCOMM_SEGMENT_BYTES applied): models default to them, so predictions and the crossover size
# follow whatever the engine will do. Asked from the engine when first needed (`engine_setting`),
# so that importing the planner loads neither torch nor the extension; the module attributes
# SMALL_ALLREDUCE_BYTES, SEGMENT_BYTES (0: adaptive), MIN_SEGMENT_BYTES and MAX_SEGMENT_BYTES
# (CollectiveContext::segmentBytesFor clamps to them) read them likewise.
_ENGINE_ATTRIBUTES = {"SMALL_ALLREDUCE_BYTES": "small_allreduce_bytes", "SEGMENT_BYTES": "segment_bytes",
                      "MIN_SEGMENT_BYTES": "min_segment_bytes", "MAX_SEGMENT_BYTES": "max_segment_bytes"}
DEFAULT_ALPHA_SECONDS = 50e-6          # one TCP message on a LAN, order of magnitude


def engine_setting(name: str) -> int:
    """One of the engine's settings (a key of ``hetcomm._C.engine_settings()``), as an int."""
    return int(_engine.engine_settings()[name])


def __getattr__(name: str) -> int:
    if name in _ENGINE_ATTRIBUTES:
        return engine_setting(_ENGINE_ATTRIBUTES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ENGINE_ATTRIBUTES))


Uplink = tuple[tuple[int, ...], float, float]


def check_rate(value: float, what: str, allow_inf: bool) -> float:
    v = float(value)
    if math.isnan(v):
        raise ValueError(f"hetcomm planner: {what} is NaN")
    if v <= 0:
        raise ValueError(f"hetcomm planner: {what} must be positive, got {v!r}")
    if math.isinf(v) and not allow_inf:
        raise ValueError(f"hetcomm planner: {what} must be finite, got {v!r}")
    return v


def _rate_matrix(bw) -> np.ndarray:
    """``bw`` as a validated read-only float64 matrix with a zero diagonal."""
    try:
        rows = np.array(bw, dtype=np.float64)
    except ValueError:
        rows = None
    if rows is None or rows.ndim != 2 or rows.shape[0] != rows.shape[1]:
        lengths = [len(row) for row in bw]
        P = len(lengths)
        bad = next((i for i, n in enumerate(lengths) if n != P), 0)
        raise ValueError(f"hetcomm planner: the bandwidth matrix must be {P}x{P}; row {bad} has {lengths[bad] if lengths else 0} "
                         "entries")
    P = rows.shape[0]
    if P < 1:
        raise ValueError("hetcomm planner: the bandwidth matrix is empty")
    np.fill_diagonal(rows, 1.0)
    bad = ~(np.isfinite(rows) & (rows > 0))
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        check_rate(rows[i, j], f"bandwidth of link {i} -> {j}", allow_inf=False)
    np.fill_diagonal(rows, 0.0)
    rows.setflags(write=False)
    return rows


def _laminar_uplinks(uplinks, P: int) -> tuple[Uplink, ...]:
    """Validated uplink groups, sorted by size (largest first) then ranks; a set named twice keeps
    the smaller rate in each direction (both caps apply). Raises unless laminar."""
    merged: dict[tuple[int, ...], tuple[float, float]] = {}
    for k, entry in enumerate(uplinks):
        try:
            ranks, out_bps, in_bps = entry
            ranks = tuple(sorted(int(r) for r in ranks))
        except (TypeError, ValueError):
            raise ValueError(f"hetcomm planner: uplink {k} must be (ranks, out_bps, in_bps), got {entry!r}") from None
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < P for r in ranks):
            raise ValueError(f"hetcomm planner: uplink {k} ranks {ranks} must be distinct ranks of 0..{P - 1}")
        out_bps = check_rate(out_bps, f"uplink {k} out rate", allow_inf=True)
        in_bps = check_rate(in_bps, f"uplink {k} in rate", allow_inf=True)
        if ranks in merged:
            out_bps, in_bps = min(out_bps, merged[ranks][0]), min(in_bps, merged[ranks][1])
        merged[ranks] = (out_bps, in_bps)
    groups = sorted(merged, key=lambda g: (-len(g), g))
    # Laminar iff, taking groups from the largest down, every group's ranks all lie in the same
    # smallest group seen so far (or in none): then it nests there; otherwise it straddles two.
    inside = [-1] * P
    for index, group in enumerate(groups):
        parents = {inside[r] for r in group}
        if len(parents) != 1:
            other = groups[max(parents)]
            raise ValueError(f"hetcomm planner: uplink groups {group} and {other} overlap without one holding the "
                             "other: shared links must nest (a host inside a site) or be disjoint")
        for r in group:
            inside[r] = index
    return tuple((g, merged[g][0], merged[g][1]) for g in groups)


@dataclass(frozen=True, eq=False)
class LinkModel:
    """What the planner knows about the cluster; all rates in bytes per second.

    ``bw[i][j]``: bandwidth of the directed link i -> j (a read-only numpy matrix); every
    off-diagonal entry must be finite and positive (the diagonal is ignored and stored as 0).
    ``reduce_bps[i]``: how fast rank i adds received data into its buffer (``inf``: never the
    bottleneck; default all ``inf``). ``alpha``: seconds per message (one ring step).
    ``uplinks``: links that several ranks share, as ``(ranks, out_bps, in_bps)`` triples: all
    traffic from a rank of ``ranks`` to a rank outside them shares ``out_bps``, all traffic into
    them from outside shares ``in_bps`` (``inf``: unshared in that direction); a host's NIC and a
    site behind one WAN uplink are the examples. Groups must be laminar (disjoint or nested);
    they are stored largest first. ``segment_bytes``: the engine's ``HETCOMM_SEGMENT_BYTES``
    (0: adaptive, as the engine). ``small_allreduce_bytes``: the engine's
    ``HETCOMM_SMALL_ALLREDUCE_BYTES``. Both default (None) to the engine's own values. Invalid
    values raise ValueError naming them. Immutable, hashable, and equal to another model with the
    same values.
    """

    bw: np.ndarray
    reduce_bps: Optional[tuple[float, ...]] = None
    alpha: float = DEFAULT_ALPHA_SECONDS
    segment_bytes: Optional[int] = None
    small_allreduce_bytes: Optional[int] = None
    uplinks: tuple[Uplink, ...] = ()

    def __post_init__(self) -> None:
        bw = _rate_matrix(self.bw)
        P = bw.shape[0]
        if self.reduce_bps is None:
            reduce_bps = (math.inf,) * P
        else:
            reduce_bps = tuple(self.reduce_bps)
            if len(reduce_bps) != P:
                raise ValueError(f"hetcomm planner: reduce_bps has {len(reduce_bps)} entries for {P} ranks")
            reduce_bps = tuple(check_rate(r, f"reduce throughput of rank {i}", allow_inf=True)
                               for i, r in enumerate(reduce_bps))
        alpha = float(self.alpha)
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"hetcomm planner: alpha must be finite and >= 0 seconds, got {self.alpha!r}")
        for name in ("segment_bytes", "small_allreduce_bytes"):
            value = getattr(self, name)
            if value is None:
                value = engine_setting(name)
                object.__setattr__(self, name, value)
            if int(value) != value or value < 0:
                raise ValueError(f"hetcomm planner: {name} must be a non-negative integer, got {value!r}")
        object.__setattr__(self, "uplinks", _laminar_uplinks(self.uplinks, P))
        object.__setattr__(self, "bw", bw)
        object.__setattr__(self, "reduce_bps", reduce_bps)
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "segment_bytes", int(self.segment_bytes))
        object.__setattr__(self, "small_allreduce_bytes", int(self.small_allreduce_bytes))

    def _key(self) -> tuple:
        return (self.bw.shape, self.bw.tobytes(), self.reduce_bps, self.alpha, self.segment_bytes,
                self.small_allreduce_bytes, self.uplinks)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LinkModel):
            return NotImplemented
        if self is other:
            return True
        if self._hash != other._hash or self.bw.shape != other.bw.shape:
            return False
        return (np.array_equal(self.bw, other.bw) and self.reduce_bps == other.reduce_bps and self.alpha == other.alpha
                and self.segment_bytes == other.segment_bytes and self.uplinks == other.uplinks
                and self.small_allreduce_bytes == other.small_allreduce_bytes)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # Rebuilt through __init__: validated, the matrix read-only again, and no cached hash
        # (str and bytes hashes differ from process to process) carried over.
        return (LinkModel, (np.array(self.bw), self.reduce_bps, self.alpha, self.segment_bytes,
                            self.small_allreduce_bytes, self.uplinks))

    @functools.cached_property
    def _hash(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"LinkModel(P={self.world_size}, bw {self.min_link:.4g}..{self.bw.max():.4g} B/s, "
                f"alpha={self.alpha:g}, uplinks={len(self.uplinks)})")

    @property
    def world_size(self) -> int:
        return self.bw.shape[0]

    @functools.cached_property
    def reduce_array(self) -> np.ndarray:
        return np.asarray(self.reduce_bps, dtype=np.float64)

    @functools.cached_property
    def min_link(self) -> float:
        """The slowest link (0 for a single rank)."""
        if self.world_size < 2:
            return 0.0
        return float(np.where(np.eye(self.world_size, dtype=bool), np.inf, self.bw).min())

    @functools.cached_property
    def max_link(self) -> float:
        return float(self.bw.max()) if self.world_size > 1 else 0.0

    def restricted(self, ranks: Sequence[int]) -> "LinkModel":
        """The model of the group made of ``ranks`` (indices into this model), in that order:
        rank k of the result is ``ranks[k]`` here."""
        ranks = [int(r) for r in ranks]
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"hetcomm planner: {ranks} are not distinct ranks of a {self.world_size}-rank model")
        index = {r: k for k, r in enumerate(ranks)}
        uplinks = tuple((tuple(index[r] for r in group if r in index), out_bps, in_bps)
                        for group, out_bps, in_bps in self.uplinks if any(r in index for r in group))
        idx = np.asarray(ranks)
        return LinkModel(bw=self.bw[np.ix_(idx, idx)], reduce_bps=tuple(self.reduce_bps[i] for i in ranks),
                         alpha=self.alpha, segment_bytes=self.segment_bytes,
                         small_allreduce_bytes=self.small_allreduce_bytes, uplinks=uplinks)

    @staticmethod
    def from_nics(nic_bps: Sequence[float], reduce_bps: Optional[Sequence[float]] = None,
                  alpha: float = DEFAULT_ALPHA_SECONDS, **engine: int) -> "LinkModel":
        """One full-duplex NIC per rank: ``bw[i][j] = min(nic[i], nic[j])``.

        In a ring every rank sends to one peer and receives from one, so a transfer i -> j is
        limited by i's egress and j's ingress and by nothing else. A schedule that talks to
        several peers at once (the hierarchical one) shares the NIC among them: each NIC is also
        an uplink of its rank. ``engine``: ``segment_bytes``, ``small_allreduce_bytes``.
        """
        nics = np.array([check_rate(v, f"NIC bandwidth of rank {i}", allow_inf=False) for i, v in enumerate(nic_bps)])
        return LinkModel(bw=np.minimum.outer(nics, nics), reduce_bps=None if reduce_bps is None else tuple(reduce_bps),
                         alpha=alpha, uplinks=tuple(((i,), float(c), float(c)) for i, c in enumerate(nics)), **engine)

    @staticmethod
    def from_levels(hosts: Sequence[int], sites: Sequence[int], *, host_out: Sequence[float],
                    host_in: Sequence[float], loopback: Sequence[float],
                    cross_site: Optional[Sequence[Sequence[float]]] = None,
                    site_out: Optional[Sequence[float]] = None, site_in: Optional[Sequence[float]] = None,
                    reduce_bps: Optional[Sequence[float]] = None, alpha: float = DEFAULT_ALPHA_SECONDS,
                    **engine: int) -> "LinkModel":
        """A model from rates per level (host h, site s; labels numbered 0.., one per rank):

        * ranks of one host talk at ``loopback[h]``;
        * ranks of hosts a != b in one site at ``min(host_out[a], host_in[b])``: the NICs;
        * ranks of hosts in sites s != t at ``min(host_out[a], cross_site[s][t], host_in[b])``: one
          flow across the sites' link (``inf`` or no ``cross_site``: the NICs alone);
        * every host is an uplink of its ranks (``host_out``, ``host_in``: its NIC), and with
          ``site_out`` / ``site_in`` given every site is one of its ranks: what all of its flows to
          (from) other sites get together. A site of one host keeps the smaller of the two rates.
        """
        host_of = np.asarray(hosts, dtype=np.int64)
        site_of = np.asarray(sites, dtype=np.int64)
        P = len(host_of)
        if len(site_of) != P:
            raise ValueError(f"hetcomm planner: {P} host labels but {len(site_of)} site labels")
        H, S = int(host_of.max()) + 1, int(site_of.max()) + 1
        out_h = np.asarray(host_out, dtype=np.float64)
        in_h = np.asarray(host_in, dtype=np.float64)
        loop = np.asarray(loopback, dtype=np.float64)
        if not (len(out_h) == len(in_h) == len(loop) == H):
            raise ValueError(f"hetcomm planner: host rates must have one entry per host ({H})")
        bw = np.minimum.outer(out_h[host_of], in_h[host_of])
        if S > 1 and cross_site is not None:
            cross = np.asarray(cross_site, dtype=np.float64)
            between = site_of[:, None] != site_of[None, :]
            bw = np.where(between, np.minimum(bw, cross[site_of][:, site_of]), bw)
        same_host = host_of[:, None] == host_of[None, :]
        bw = np.where(same_host, loop[host_of][:, None], bw)
        members = [tuple(int(r) for r in np.flatnonzero(host_of == h)) for h in range(H)]
        uplinks = [(members[h], float(out_h[h]), float(in_h[h])) for h in range(H)]
        if S > 1 and site_out is not None:
            for s in range(S):
                ranks = tuple(int(r) for r in np.flatnonzero(site_of == s))
                uplinks.append((ranks, float(site_out[s]), float(site_in[s])))
        return LinkModel(bw=bw, reduce_bps=None if reduce_bps is None else tuple(reduce_bps), alpha=alpha,
                         uplinks=tuple(uplinks), **engine)

    def with_rank_uplinks(self) -> "LinkModel":
        """This model with each rank's traffic capped by its fastest link in each direction, for
        models measured one pair at a time (which cannot show what concurrent flows share): a
        rank talking to several peers at once is assumed to get no more than its best single
        link. Unchanged if it already has uplinks."""
        if self.uplinks or self.world_size < 2:
            return self
        out_best, in_best = self.bw.max(axis=1), self.bw.max(axis=0)
        ups = tuple(((i,), float(out_best[i]), float(in_best[i])) for i in range(self.world_size))
        return dataclasses.replace(self, uplinks=ups)

    def group_of(self) -> np.ndarray:
        """For each uplink group (in ``uplinks`` order), a boolean row of its members: (G, P)."""
        G, P = len(self.uplinks), self.world_size
        out = np.zeros((G, P), dtype=bool)
        for g, (ranks, _, _) in enumerate(self.uplinks):
            out[g, list(ranks)] = True
        return out

    @functools.cached_property
    def membership(self) -> "scipy.sparse.csr_matrix":
        """`group_of` as a sparse float matrix (kept with the model: loads sum through it)."""
        import scipy.sparse as sparse  # here, not at import: only the planning rank needs SciPy
        return sparse.csr_matrix(self.group_of().astype(np.float64))
