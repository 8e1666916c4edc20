"""What a generation of `ElasticRun` (`hetcomm.train.elastic.run`) starts from, agreed over its
process group: the group's members hold the job's secret, the store does not, so nothing here is
read from the store, and nothing is unpickled (a member's bytes are numbers and UTF-8, checked).

* `start_table`: every member's worker name, the round and outer steps it carries in, its
  samples, and whether the decision (from the store) names a round other than the one this
  member holds: the worker labels and the run's counts follow from it on every rank alike.
* `share_timing`: rank 0's step times (by worker name) and ``time`` policy state, as numbers.
* `take_round` and `resume_round`: the round a generation ended inside of (workers wait to join,
  or a collective failed) goes on in the next generation: each rank keeps what its replica moved
  since the round began (never sent), and its counts; the joiners contribute to the same round.
  With overlap, the reductions a failure left unapplied on every member (the round boundary's
  synchronisation in flight, staggered fragments' jobs: failed, or cancelled behind a failed
  one) are not lost: a rank adds the pseudo-gradients it sent in them to what it carries (and
  their steps and samples, or the fragment's window), so that they are reduced in the next
  generation. Where a holder of the state applied them (the reduction ended there before the
  failure), the state it sends holds them, and they are dropped (`added`). A round taken inside its synchronous boundary
  (the last round's) that no member finished goes on without the fragments whose reductions a
  member applied (`Round.sent`).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from hetcomm.train import flat as _flat
from hetcomm.train.local_steps import TimeSteps
from hetcomm.train.partition import exchange_columns

NAME_BYTES = 128              # a worker's name, UTF-8 (`Elastic(worker=)`, `worker_id`)
_HEAD = 19                    # rows before the name's bytes
_FIRED_BITS = 50              # staggered fragments whose "fired" flags travel (exactly, in a float64)
_JOB_BITS = 50                # ... and the latest background reductions, whether applied or lost
_BITS_MAX = (1 << 50) - 1


def job_bits(orders, submitted: int) -> int:
    """Background reductions (their numbers, `DiLoCo._jobs`) as bits: bit i is the reduction
    ``submitted − 1 − i``, the latest 50 (older ones are left out)."""
    return sum(1 << (submitted - 1 - o) for o in set(orders) if 0 <= submitted - 1 - o < _JOB_BITS)


def _from_bits(bits: int, submitted: int) -> set[int]:
    return {submitted - 1 - i for i in range(_JOB_BITS) if bits >> i & 1 and submitted - 1 - i >= 0}


def encode_name(name: str) -> list[float]:
    raw = name.encode()
    if len(raw) > NAME_BYTES:
        raise ValueError(f"a worker's name is at most {NAME_BYTES} bytes of UTF-8, got {len(raw)}: {name[:40]!r}...")
    return [float(b) for b in raw] + [0.0] * (NAME_BYTES - len(raw))


def _decode_name(values) -> str:
    raw = bytes(int(v) & 0xFF for v in values if 0 < v < 256)
    return raw.decode("utf-8", "replace")


def start_table(name: str, explicit: bool, carried_round: int, carried_applied: int, samples: int,
                disowned: bool, carried: tuple | None = None, jobs: tuple[int, int, int] | None = None) -> dict:
    """One exchange over the generation's group. ``disowned``: this member holds the run's state
    and the decision names another round than its own (a forged record on the store).
    ``carried``: `Round.summary` of the round this member carries in, if any. ``jobs``: the last
    generation it was in, the background reductions submitted there and those applied here
    (`job_bits`), if any."""
    steps, total, compute, fired, sending, cut, lost, lost_steps, lost_sum, lost_bits, lost_boundary = \
        carried or (-1, 0.0, 0.0, 0, -1, False, False, 0, 0.0, 0, -1)
    gen, submitted, applied_bits = jobs or (-1, 0, 0)
    column = [float(carried_round), float(carried_applied), float(samples), float(explicit), float(disowned),
              float(steps), float(total), float(compute), float(fired), float(sending), float(cut),
              float(lost), float(lost_steps), float(lost_sum), float(gen), float(submitted), float(applied_bits),
              float(lost_bits), float(lost_boundary)]
    table = exchange_columns(column + encode_name(name))
    world = len(table[0])
    names = [_decode_name([table[_HEAD + i][r] for i in range(NAME_BYTES)]) for r in range(world)]
    return {"rounds": _counts(table[0], "rounds"), "applied": _counts(table[1], "outer steps"),
            "samples": _counts(table[2], "samples"), "explicit": [x > 0 for x in table[3]],
            "disowned": [r for r in range(world) if table[4][r] > 0], "names": names,
            "carried": {"steps": _counts(table[5], "carried steps", least=-1), "sum": list(table[6]),
                        "compute": [x if math.isfinite(x) and 0 <= x <= _LONGEST else math.nan for x in table[7]],
                        "fired": _counts(table[8], "fragments fired", most=(1 << _FIRED_BITS) - 1),
                        "sending": _counts(table[9], "outer steps", least=-1), "cut": [x > 0 for x in table[10]],
                        "lost": [x > 0 for x in table[11]], "lost_steps": _counts(table[12], "lost steps"),
                        "lost_sum": list(table[13]), "gen": _counts(table[14], "generation", least=-1),
                        "jobs": _counts(table[15], "reductions"),
                        "applied_bits": _counts(table[16], "reductions applied", most=_BITS_MAX),
                        "lost_bits": _counts(table[17], "reductions lost", most=_BITS_MAX),
                        "lost_boundary": _counts(table[18], "lost boundary's reduction", least=-1)}}


_LONGEST = 7 * 86400.0        # seconds a carried round may have lasted (longer: not taken into the deadline)


def _counts(values, what: str, least: int = 0, most: int = (1 << 53) - 1) -> list[int]:
    """Whole numbers in [least, most] from a generation's members (each rank checks the same table:
    a member that sends anything else stops every rank alike)."""
    out = []
    for r, x in enumerate(values):
        if not (math.isfinite(x) and x == int(x) and least <= x <= most):
            raise ValueError(f"rank {r} of the generation sent {x!r} as its {what}: not a whole number in "
                             f"[{least}, {most}] (a corrupted or malicious member)")
        out.append(int(x))
    return out


@dataclasses.dataclass
class Round:
    """This rank's part of a round that a generation ended inside of: what the replica moved
    (``start − replica``, master precision: never sent), the round's counts, the staggered
    fragments' windows, and the run's outer steps applied when it was taken and, when it was
    taken inside the round's reduction, when that began (the state the next generation starts
    from may hold the round then, whole or in part: `decide`, `held_out`)."""
    delta: torch.Tensor
    counts: tuple[int, int, float, float, int]     # steps, samples, compute seconds, loss sum, loss samples
    windows: tuple[list[int], list[list[int]], list[bool]] | None    # seen, at each trigger, fired
    applied: int
    sending: int | None
    cut: bool = False             # taken at a boundary a join cut (else after a failure)
    lost: "Lost | None" = None    # reductions sent and applied nowhere here (overlap)
    added: bool = False           # `resume_round` added them to the round
    added_lost: "Lost | None" = None    # ... those of them it added (`added`; None: all)
    check: float | None = None    # with sharded state: the replica's sum (``delta`` is this rank's share's)
    # Inside the synchronous boundary: fragment -> the run's outer steps before the reduction that
    # took this rank's progress in it (`Agreement._send`); a member that applied more holds it.
    sent: dict[int, int] = dataclasses.field(default_factory=dict)
    held_out: list[int] = dataclasses.field(default_factory=list)   # `resume_round` took those out

    def summary(self, submitted: int | None = None) -> tuple[int, float, float, int, int, bool, bool, int, float,
                                                             int, int]:
        """steps, a float64 sum of the progress (equal over a worker's ranks), compute seconds, the
        fragments fired (bits), the outer steps applied when it began to send (-1: it had not),
        whether a join cut it; whether reductions were lost, their steps and the float64 sum of
        their pseudo-gradients, which they were (`Lost.bits`, counted back from ``submitted``,
        the reductions of the generation that `start_table` names) and the boundary's number."""
        flags = self.windows[2] if self.windows and len(self.windows[2]) <= _FIRED_BITS else []
        lost = self.lost
        total = self.check if self.check is not None else float(torch.sum(self.delta, dtype=torch.float64))
        return (self.counts[0], total, self.counts[2],
                sum(1 << f for f, x in enumerate(flags) if x), -1 if self.sending is None else self.sending, self.cut,
                lost is not None, lost.counts[0] if lost is not None and lost.counts else 0,
                lost.total() if lost is not None else 0.0, lost.bits(submitted) if lost is not None else 0,
                lost.boundary if lost is not None and lost.bits(submitted) else -1)

    def describe(self, kept: bool) -> str:
        """What became of it (`resume_round` returned ``kept``), for the log."""
        if not kept:
            return ("this worker's steps in it are dropped (the state holds them already, its worker's other rank "
                    "has none, or they are not finite)")
        without = (f", without fragment(s) {', '.join(map(str, self.held_out))} of it that the state holds already"
                   if self.held_out else "")
        if not self.added:
            return f"{self.counts[0]} steps carried in{without}"
        lost = self.added_lost or self.lost
        jobs = (lost.counts is not None) + len(lost.windows)
        held = (self.lost.counts is not None) + len(self.lost.windows) - jobs
        return (f"{self.counts[0]} steps carried in, and {jobs} reduction(s) in flight that the failure left "
                f"unapplied ({lost.counts[0] if lost.counts else 0} more steps)"
                + (f"; {held} other(s) it lost the state holds" if held else ""))


@dataclasses.dataclass
class Lost:
    """The reductions of a rank's generation that a failure left unapplied here (overlap): the
    pseudo-gradients it sent in them (element ranges of the flat state, master precision), the
    counts of the round boundary's (None: only staggered fragments' were lost), and each lost
    fragment's window start (`Streams._at_trigger` before its trigger)."""
    parts: list[tuple[int, int, torch.Tensor]]
    counts: tuple[int, int, float, float, int] | None
    windows: dict[int, list[int]]
    # The number (`DiLoCo._jobs`) of each part's reduction (-1: unknown), of the boundary's (the
    # counts'; -1: not lost, or unknown) and of each lost fragment's; the reductions submitted.
    orders: list[int] = dataclasses.field(default_factory=list)
    boundary: int = -1
    jobs: dict[int, int] = dataclasses.field(default_factory=dict)
    submitted: int = 0

    def total(self) -> float:
        return sum(float(torch.sum(d, dtype=torch.float64)) for _, _, d in self.parts)

    def bits(self, submitted: int | None = None) -> int:
        """The reductions lost (`job_bits`, counted back from ``submitted``, by default the
        reductions submitted when they were lost); 0 where one's number is unknown."""
        submitted = self.submitted if submitted is None else submitted
        if len(self.orders) != len(self.parts) or any(o < 0 or not 0 <= submitted - 1 - o < _JOB_BITS
                                                      for o in self.orders):
            return 0
        return job_bits(self.orders, submitted)

    def only(self, orders: set[int]) -> "Lost | None":
        """Those of these reductions that are numbered in ``orders`` (None: none)."""
        keep = [i for i, o in enumerate(self.orders) if o in orders]
        if not keep:
            return None
        boundary = self.boundary if self.boundary in orders else -1
        return Lost([self.parts[i] for i in keep], self.counts if boundary >= 0 else None,
                    {f: w for f, w in self.windows.items() if self.jobs.get(f) in orders},
                    [self.orders[i] for i in keep], boundary,
                    {f: o for f, o in self.jobs.items() if o in orders}, self.submitted)


def _failed(future) -> bool:
    return future is not None and future.done() and (future.cancelled() or future.exception() is not None)


def _lost(inner) -> Lost | None:
    """The reductions of ``inner`` (its background jobs over) that failed or never ran, and whose
    pseudo-gradient it still holds: the round boundary's, if it applied no fragment of it here,
    and each staggered fragment's in flight (a wait that sees a job fail leaves it in
    ``_pending`` or ``_flight``). Their buffers are intact: a fragment's is written again only
    at its next trigger, after its job succeeded; the boundary's only by the second `_progress`
    after it, and `take_round` copies them before its own. Each is named by its number
    (`DiLoCo._jobs`), so that the next generation tells those a holder of the state applied."""
    if not inner.overlap:
        return None
    parts, counts, windows, orders, boundary, jobs = [], None, {}, [], -1, {}
    if _failed(inner._pending) and inner._landed == 0 and inner._pending_round is not None:
        progress, counts = inner._pending_round
        boundary = getattr(inner, "_pending_order", -1)
        for _, _, a, b in inner._boundary:
            parts.append((a, b, progress[a:b].clone()))
            orders.append(boundary)
    for f, job in sorted(inner._flight.items()):
        if _failed(job["future"]) and "window" in job:
            _, _, a, b = inner._fragments[f]
            base = inner._stream_base
            parts.append((a, b, inner._stream_delta[a - base:b - base].clone()))
            windows[f] = list(job["window"])
            jobs[f] = job.get("order", -1)
            orders.append(jobs[f])
    return Lost(parts, counts, windows, orders, boundary, jobs, getattr(inner, "_jobs", 0)) if parts else None


def take_round(inner, applied_before: int, cut: bool = False) -> Round | None:
    """The round ``inner`` (a generation's `DiLoCo`, its background jobs over) ended inside of, or
    None when it took no step in it. ``applied_before``: the run's outer steps before ``inner``;
    ``cut``: a join cut it (else a failure ended it)."""
    lost = _lost(inner)                  # (first: `_progress` may write the buffer in flight)
    if inner._r_steps < 1 and lost is None:
        return None
    if inner._sending is not None and len(inner._history) > inner._sending_from:
        return None                      # its boundary recorded the round, then failed: the state holds it
    delta = inner._progress().clone()
    windows = None
    if inner._stagger:
        windows = (list(inner._seen), [list(x) for x in inner._at_trigger], list(inner._fired))
    sharded = inner._layout is not None and inner._layout.replicated and inner._workers.size > 1
    sending = inner._sending is not None
    return Round(delta, (inner._r_steps, inner._r_samples, inner._r_compute, inner._r_loss, inner._r_loss_n),
                 windows, applied_before + inner._applied,
                 applied_before + inner._sending if sending else None, cut, lost,
                 check=inner._replica_print() if sharded else None,
                 sent={f: applied_before + a for f, a in inner._sent.items()} if sending and inner._sent else {})


def added(c: dict, applied: list[int], r: int, sharded: bool = False) -> set[int] | None:
    """Which of rank r's lost reductions go on (their numbers; None: all): those that no holder
    of the state applied. The holders are the members with the most outer steps (``applied``)
    that were in r's last generation too (``c``: `start_table`'s "carried": each member's
    reductions applied and lost there, `job_bits`): a job of r that failed, applied by the
    others, and the boundary's queued behind it, that failed on every member, hold one outer
    step of r's that the state holds and one that no one applied. (A holder that numbered
    fewer reductions never ran the others; holders that applied different ones hold different
    states, which the start of the next epoch refuses: any holder's counts.) Where the numbers are
    unknown or one of them is not among a holder's latest 50 (more than 50 fragments), no holder
    was in that generation, or the state is sharded over the workers' ranks: all of them where no
    member applied more outer steps than r did, else none."""
    if not c["lost"][r]:
        return set()
    best = max(applied)
    gens = c.get("gen", [-1] * len(applied))
    holders = [h for h in range(len(applied)) if applied[h] == best and gens[r] >= 0 and gens[h] == gens[r]]
    lost = _from_bits(c["lost_bits"][r], c["jobs"][r]) if holders else set()
    if sharded or not lost or any(c["jobs"][h] - 1 - min(lost) >= _JOB_BITS for h in holders):
        return None if applied[r] == best else set()
    held = set().union(*(_from_bits(c["applied_bits"][h], c["jobs"][h]) for h in holders))
    return lost - held


def decide(c: dict, applied: list[int], labels: list[int], sharded: bool = False,
           rounds: list[int] | None = None) -> tuple[list[bool], list[bool]]:
    """Which ranks keep their carried round, and which add lost reductions to it, from the
    generation's table (``c``: `start_table`'s "carried"; ``applied``: each rank's outer steps;
    ``labels``: each rank's worker; ``rounds``: each rank's rounds). A rank's lost reductions go on
    unless a holder of the state applied them (`added`: the state it sends holds them). A rank
    keeps its round unless it is not finite, or the round was taken
    inside its synchronous boundary (it had begun to send) and a member applied more outer steps
    since and finished that boundary (counts one round more: the state holds the whole round).
    Where no member finished it, the rank keeps the round without the fragments a member applied
    (`held_out`). A worker's ranks keep theirs only all together (the same steps and progress,
    the same lost reductions added). With the state sharded over the workers' ranks (``sharded``) the
    progress compared is the replica's sum (`Round.check`), without the lost pseudo-gradients'
    (each rank's are its share's), and a round whose boundary members applied in part is dropped;
    so is one where ``rounds`` is unknown. (A rank whose own boundary recorded the round carries
    none: `take_round`. Without staggered windows, a round kept without some fragments still
    weighs the rest by all its steps and samples.)"""
    world, best = len(labels), max(applied)
    goes = [added(c, applied, r, sharded) for r in range(world)]
    adds = [bool(c["lost"][r] and (g is None or g)) for r, g in enumerate(goes)]
    boundary = c.get("lost_boundary", [-1] * world)
    steps = [c["steps"][r] + (c["lost_steps"][r] if adds[r] and (goes[r] is None or boundary[r] in goes[r]) else 0)
             for r in range(world)]
    sums = [c["sum"][r] + (c["lost_sum"][r] if adds[r] and not sharded else 0.0) for r in range(world)]
    which = [None if g is None else frozenset(g) for g in goes]

    def whole(r: int) -> bool:
        return (c["steps"][r] >= 1 or adds[r]) and c["steps"][r] >= 0 and math.isfinite(sums[r]) \
            and (c["sending"][r] < 0 or best <= c["sending"][r]
                 or (not sharded and rounds is not None and rounds[r] == max(rounds)))
    keep = [all(whole(q) and steps[q] == steps[r] and sums[q] == sums[r] and which[q] == which[r]
                for q in range(world) if labels[q] == labels[r]) for r in range(world)]
    return keep, [a and k for a, k in zip(adds, keep)]


def resume_round(inner, mine: Round | None, start: dict, labels: list[int], sharded: dict | None = None) -> bool:
    """The carried round goes on in the new generation ``inner`` (its global parameters loaded),
    decided alike on every rank from ``start`` (`start_table`, `decide`): a rank keeps its round
    unless it was taken inside a reduction that a member finished (the state holds the round;
    with sharded state, or ``rounds`` unknown, one that a member applied in part), without the
    fragments of it the state holds (`held_out`), and a worker's ranks keep theirs
    only all together (the same steps and progress). Whoever keeps it moves its replica onto the
    new global parameters by what it carries. Every
    rank skips the fragments every keeper fired this round; the ``time`` policy's round started
    when the longest-carried round did. Returns whether this rank kept its round. With the state
    sharded over the workers' ranks (``sharded``: what `elastic.sharded.load` returned), the
    replicas are set by `elastic.sharded.resume` (a collective)."""
    c = start["carried"]
    world = len(labels)
    keep, adds = decide(c, start["applied"], labels, sharded is not None, start["rounds"])
    me = dist.get_rank()
    if sharded is not None:
        from hetcomm.train.elastic.sharded import resume
        delta, counts, windows = (None, None, None) if mine is None else (mine.delta, mine.counts, mine.windows)
        if mine is not None and adds[me] and mine.lost is not None:
            delta, counts, windows = _with_lost(mine)     # (on this rank's share, as ``delta``)
        keep = resume(inner, delta, keep, labels, sharded)
        kept = keep[me] and mine is not None
        if kept:
            mine.added = adds[me] and mine.lost is not None
            (inner._r_steps, inner._r_samples, inner._r_compute, inner._r_loss, inner._r_loss_n) = counts
            if inner._stagger and windows is not None:
                inner._seen, inner._at_trigger = list(windows[0]), [list(x) for x in windows[1]]
    kept = keep[me] and mine is not None
    if kept and sharded is None:
        delta, counts, windows = mine.delta, mine.counts, mine.windows
        take = _taking(mine.lost, added(c, start["applied"], me)) if adds[me] and mine.lost is not None else None
        if take is not None:
            delta, counts, windows = _with_lost(mine, take)
            mine.added, mine.added_lost = True, take
        delta, windows = held_out(mine, delta, windows, max(start["applied"]), inner._fragments)
        with torch.no_grad():
            _flat.load(inner._params, inner._split(inner._start - delta))
        (inner._r_steps, inner._r_samples, inner._r_compute, inner._r_loss, inner._r_loss_n) = counts
        if inner._stagger and windows is not None:
            inner._seen, inner._at_trigger = list(windows[0]), [list(x) for x in windows[1]]
    keepers = [r for r in range(world) if keep[r]]
    # A round a join cut is not cut again before it is reduced (joins never admitted, or a store
    # writer's, must not keep the run from its outer steps); one a failure ended may be.
    inner._resumed = any(c["cut"][r] for r in keepers)
    if inner._stagger and len(inner._fragments) <= _FIRED_BITS:
        inner._fired = [bool(keepers) and all(c["fired"][r] >> f & 1 for r in keepers)
                        for f in range(len(inner._fragments))]
    elapsed = max((c["compute"][r] for r in keepers if math.isfinite(c["compute"][r])), default=0.0)
    policy = inner._policy
    if elapsed > 0 and isinstance(policy, TimeSteps) and policy.deadline is not None:
        now = inner._clock()
        policy.start_round(now, start=now - elapsed)
    return kept


def held_out(mine: Round, delta: torch.Tensor, windows, best: int, fragments) -> tuple:
    """``mine``'s progress without the fragments whose reduction inside its synchronous boundary a
    member applied (it had sent them: the state it receives holds them; ``best``: the most outer
    steps a member applied), each such fragment's window begun afresh; `Round.held_out` names them."""
    mine.held_out = sorted(f for f, before in mine.sent.items() if before < best and 0 <= f < len(fragments))
    if not mine.held_out:
        return delta, windows
    delta = delta.clone()                 # (a retried `_build` resumes ``mine`` again)
    for f in mine.held_out:
        _, _, a, b = fragments[f]
        delta[a:b] = 0
    if windows is not None:
        at_trigger = [list(x) for x in windows[1]]
        for f in mine.held_out:
            if f < len(at_trigger):
                at_trigger[f] = list(windows[0])
        windows = (windows[0], at_trigger, windows[2])
    return delta, windows


def _taking(lost: Lost, orders: set[int] | None) -> Lost | None:
    """The reductions of ``lost`` numbered ``orders`` (None: all; `added`)."""
    return lost if orders is None else lost.only(orders)


def _with_lost(mine: Round, lost: Lost | None = None) -> tuple:
    """``mine``'s progress, counts and windows with its lost reductions (``lost``, default
    all of them) added back: their pseudo-gradients on their element ranges, the boundary's
    steps and samples, each lost fragment's window reopened where it began."""
    lost = mine.lost if lost is None else lost
    delta = mine.delta.clone()            # (a retried `_build` resumes ``mine`` again)
    for a, b, part in lost.parts:
        delta[a:b] += part
    counts = mine.counts
    if lost.counts is not None:
        counts = tuple(x + y for x, y in zip(counts, lost.counts))
    windows = mine.windows
    if windows is not None and lost.windows:
        at_trigger = [list(x) for x in windows[1]]
        for f, start in lost.windows.items():
            if 0 <= f < len(at_trigger):
                at_trigger[f] = list(start)
        windows = (windows[0], at_trigger, windows[2])
    return delta, counts, windows


def share_timing(step_times: dict[str, tuple[float, int, float | None]], policy: dict | None,
                 names: list[str]) -> tuple[dict[str, tuple[float, int, float | None]], dict | None]:
    """Rank 0's step times of this generation's workers (``names``, one per worker: seconds per
    step, windows, the steps' EMA, `StepTimes`) and its ``time`` policy state, broadcast as
    float64 and checked: every rank plans alike."""
    values = []
    for name in names:
        t, windows, n = step_times.get(name, (math.nan, 0, None))
        values += [float(t), float(windows), _num(n)]
    p = policy or {}
    values += [1.0 if policy is not None else 0.0, _num(p.get("round_seconds")), _num(p.get("sync_seconds")),
               _num(p.get("stretch"))]
    flat = torch.tensor(values, dtype=torch.float64)
    dist.broadcast(flat, src=0)
    values = flat.tolist()
    times = {}
    for i, name in enumerate(names):
        t, windows, n = values[3 * i:3 * i + 3]
        # (bounded: a step of a week, or an EMA of 2^30 steps, would freeze or overflow the plans)
        if 0 < t <= _LONGEST and math.isfinite(windows) and windows >= 0:
            times[name] = (t, int(min(windows, 1 << 30)), n if 0 < n <= (1 << 30) else None)
    has, round_seconds, sync_seconds, stretch = values[3 * len(names):]
    if not has:
        return times, None
    return times, {"name": "time", "round_seconds": _positive(round_seconds),
                   "sync_seconds": sync_seconds if 0 <= sync_seconds <= _LONGEST else None,
                   "stretch": stretch if 1.0 <= stretch <= _LONGEST else 1.0}


def _num(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _positive(value: float) -> float | None:
    return value if 0 < value <= _LONGEST else None


def seed_policy(inner, names: list[str], step_times: dict, policy_state: dict | None) -> None:
    """The step times measured in earlier generations (by worker name, ``names`` the generation's
    workers') and the ``time`` policy's round length: the generation ``inner`` plans its first
    round from them instead of measuring again (a worker never measured counts as the slowest
    measured one, and is measured in that round)."""
    times = inner._times
    for label, name in enumerate(names):
        if name in step_times:
            times._t[label], times._windows[label], times._n[label] = step_times[name]
    if policy_state is not None and isinstance(inner._policy, TimeSteps):
        inner._policy.load_state_dict(policy_state)
        if not inner.overlap:
            inner._policy.sync_seconds = None
    if times.estimates() is None:
        return
    inner._policy.agreed(times)
    inner._policy.start_round(inner._clock())
    inner._plan_triggers()
    inner._mark = inner._clock()
