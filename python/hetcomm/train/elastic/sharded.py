"""An elastic run's state sharded over its workers' ranks (``hetcomm.DiLoCo(..., membership=
hetcomm.Elastic(...), shard_state=True)``): each generation's DiLoCo keeps, on each rank of a
worker, only that rank's share of the global parameters and of the outer optimizer's state
(`diloco.shard.Layout`), and the run keeps nothing beside it. When the generation ends, the
shares stay where they are; the next generation, whose shares may differ (the smallest worker's
size, a rank's index in its worker, members gone or new), gets them from the members that hold
them (`load`):

* The epoch names the holders, the members that applied the most outer steps (a worker's ranks
  step their ranges all together or not at all: `DiLoCo._reduce_agreed`, so every range of a
  holder is at that count). Each member says which share it holds and which it needs; the moves
  (`reshard.plan`) take every range a member needs from a holder of it, point to point over the
  generation's group (`reshard.move`): the global parameters, then each tensor of the outer
  optimizer's state. Its values of one per tensor (Adam's step), and whether a tensor has state
  at all, travel as one value per model tensor, from every holder of a piece of it, in one
  exchange (before, a value per element: 8 bytes for each of the model's parameters). A range no holder
  has left (every rank that held it is gone) ends the run with a ValueError naming it.
* The members then compare what they received: ranks holding the same share must hold the same
  bits (`flat.additive_print`), or every rank raises.
* The epoch itself sends only the run's metadata (round, samples, history, membership) to the
  members without the state (`send_meta`), and no fingerprint of the global parameters; the
  rounds' records carry the hash of the whole global parameters, summed from the shares over
  each worker (`DiLoCo._global_print`).
* A round carried on (`carry`): each rank carries what its replica moved on its old share
  (``start − replica`` there, with the pseudo-gradients of the reductions in flight that a
  failure left unapplied, `carry.Lost`, added where the whole-state run adds them), and the
  worker's ranks move it onto their new shares (`resume`, the same moves); each writes the new
  global parameters less it into its share of the replica, and the worker's ranks exchange their
  shares of the replica. A worker whose ranks' old shares no longer cover the model (a rank is
  gone) starts from the new global parameters, as does every worker that carries nothing.

Checkpoints (`load_checkpoint`): each rank saves its share and the fragments it is cut from; a
whole job restarted from them starts an era whose holders (the latest round's) hold those shares,
and the first generation moves them as any other. Not yet: the transfer to joiners in the
generation's background (`handover`): the shares move when the generation starts.
"""
from __future__ import annotations

import bisect
import math

import torch
import torch.distributed as dist

from hetcomm.train import flat as _flat
from hetcomm.train.diloco.outer import PER_PARAMETER
from hetcomm.train.diloco.shard import Layout, _offsets
from hetcomm.train.elastic.common import _PREFIX
from hetcomm.train.elastic.generation import _broadcast_meta
from hetcomm.train.elastic.reshard import Share, intervals, move, plan
from hetcomm.train.partition import exchange_columns

# The most shards a share may name (a member that sends more is not believed).
_MAX_SHARDS = 4096


def share_of(inner) -> tuple[int, int | None]:
    """(shards, index) of what a generation's DiLoCo keeps: (1, 0) for the whole state."""
    layout = inner._layout
    return (1, 0) if layout is None else (layout.shards, layout.index)


def whole_fragments(inner) -> list[tuple[int, int, int, int]]:
    return list(inner._layout.whole) if inner._layout is not None else list(inner._fragments)


def global_parameters(run) -> list[torch.Tensor]:
    """`ElasticRun.global_parameters` while a rank holds a share: the model's parameters once the
    run has finished (`DiLoCo.finish` left the global parameters there), else a RuntimeError."""
    if run._inner is not None or not run._model_global:
        raise RuntimeError(f"{_PREFIX}: global_parameters() of a run whose state is sharded over its workers' ranks: "
                           "this rank holds only its share until the run has finished")
    return [p.detach().to("cpu", run._master).clone() for p in run._params]


def fingerprint(whole: list[torch.Tensor]) -> int:
    """The rounds' hash (`DiLoCo._global_print`) of whole global parameters."""
    return _flat.print_bits(_flat.additive_print(whole, _offsets(g.numel() for g in whole)[:-1]))


def load_checkpoint(run, state: dict, version: int) -> None:
    """`ElasticRun.load_state_dict` of a checkpoint of a run with sharded state: this rank's share
    of the global parameters and of the outer optimizer (pieces of the model's tensors, as the
    generation that saved it laid them out), checked against this worker's model, and the rest as
    a whole-state checkpoint holds it. The epoch that starts the era moves the shares from the
    workers with the latest round (`load`): restart every rank of a worker, or a range is lost."""
    if not run._sharded or "share" not in state:
        raise ValueError(f"{_PREFIX}: a checkpoint of a run " + ("with" if "share" in state else "without") +
                         " sharded state resumes a run constructed " + ("with" if "share" in state else "without") +
                         " shard_state=True")
    if state.get("version") != version:
        raise ValueError(f"{_PREFIX}: checkpoint version {state.get('version')!r}, expected {version}")
    n = sum(p.numel() for p in run._params)
    try:
        shards, index = (int(x) if x is not None else None for x in state["share"])
        whole = [tuple(int(x) for x in f) for f in state["fragments"]]
        pieces = list(state["global"])
        if not (1 <= shards <= _MAX_SHARDS and (index is None or 0 <= index < shards)
                and all(isinstance(t, torch.Tensor) for t in pieces)):
            raise ValueError(f"share {index} of {shards}")
        if not (whole and whole[0][2] == 0 and whole[-1][3] == n
                and all(a[3] == b[2] and a[2] < a[3] for a, b in zip(whole, whole[1:] + [(0, 0, n, n + 1)]))):
            raise ValueError(f"its fragments do not cover this worker's model ({n} elements)")
        layout = Layout(run._params, whole, shards, index) if shards > 1 else None
    except (TypeError, ValueError, IndexError, KeyError, ZeroDivisionError) as e:
        raise ValueError(f"{_PREFIX}: the checkpoint's share does not fit this worker's model ({e})") from e
    proxies = [torch.nn.Parameter(torch.empty(p.shape, dtype=run._master, device="meta")) for p in run._params]
    template = run._factory(proxies)
    if state.get("outer_type", type(template).__name__) != type(template).__name__:
        raise ValueError(f"{_PREFIX}: the checkpoint's outer optimizer is a {state['outer_type']}; this run's "
                         f"{type(template).__name__}")
    if layout is None:                # (saved while every rank of a generation kept the whole state)
        if [tuple(t.shape) for t in pieces] != [tuple(p.shape) for p in run._params]:
            raise ValueError(f"{_PREFIX}: the checkpoint's global parameters do not match the model's shapes")
        with torch.no_grad():
            run._global = [torch.nn.Parameter(t.detach().to(run._master).clone()) for t in pieces]
        run.outer_optimizer = run._factory(run._global)
    else:
        if [t.numel() for t in pieces] != [k for _, _, k in layout.pieces]:
            raise ValueError(f"{_PREFIX}: the checkpoint's share of the global parameters does not match the model")
        with torch.no_grad():
            run._global = [torch.nn.Parameter(t.detach().reshape(-1).to(run._master).clone()) for t in pieces]
        group_of = {id(p): k for k, g in enumerate(template.param_groups) for p in g["params"]}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in template.param_groups]
        for piece, (t, _, _) in zip(run._global, layout.pieces):
            if id(proxies[t]) in group_of:
                groups[group_of[id(proxies[t])]]["params"].append(piece)
        run.outer_optimizer = type(template)(groups)
    try:
        run.outer_optimizer.load_state_dict(state["outer_optimizer"])
    except (ValueError, KeyError, IndexError, TypeError, RuntimeError) as e:
        raise ValueError(f"{_PREFIX}: the checkpoint's outer optimizer state does not load ({e})") from e
    run.model.load_state_dict(state["model"])
    if state["inner_optimizer"] is not None and run.inner_optimizer is not None:
        run.inner_optimizer.load_state_dict(state["inner_optimizer"])
    run._round, run._samples_total = int(state["round"]), int(state["samples_total"])
    run._history, run._events = list(state["history"]), list(state["membership"])
    run._share, run._whole = (shards, index), whole
    run._holds = run._checkpoint = True


def check_factory(factory, params) -> None:
    """``shard_state=True`` needs an element-wise outer optimizer (`diloco.outer.PER_PARAMETER`):
    a ValueError now, rather than a warning at each generation."""
    proxies = [torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device="meta")) for p in params]
    kind = type(factory(proxies))
    if kind not in PER_PARAMETER:
        allowed = ", ".join(sorted(c.__name__ for c in PER_PARAMETER))
        raise ValueError(f"{_PREFIX}: shard_state=True steps the outer optimizer on pieces of tensors, which only "
                         f"element-wise optimizers allow ({allowed}); {kind.__name__} is not known to be: use "
                         "shard_state=False")


def send_meta(run, decision: dict) -> None:
    """The epoch's transfer with sharded state: the first holder's round, samples, history and
    membership records to every member (the state itself moves when the generation starts)."""
    members, first = decision["members"], decision["holders"][0]
    mine = run._me == first
    meta = {"round": run._round, "samples_total": run._samples_total, "history": list(run._history),
            "membership": list(run._events), "codec": run._codec_name,
            "shapes": [list(p.shape) for p in run._params]} if mine else None
    meta = _broadcast_meta(meta, members.index(first))
    if mine:
        return
    shapes = [list(p.shape) for p in run._params]
    if meta.get("shapes") != shapes or meta.get("codec") != run._codec_name:
        raise ValueError(f"{_PREFIX}: this worker cannot join: the run's model has parameter shapes "
                         f"{meta.get('shapes')} and {meta.get('codec')}; this worker's {shapes} and {run._codec_name}")
    if not (all(isinstance(meta.get(k), int) and not isinstance(meta[k], bool) and meta[k] >= 0
                for k in ("round", "samples_total"))
            and all(isinstance(meta.get(k), list) and all(isinstance(r, dict) for r in meta[k])
                    for k in ("history", "membership"))):
        raise ValueError(f"{_PREFIX}: this worker cannot join: the holders announced a malformed state (round, "
                         "samples, history or membership)")
    run._round, run._samples_total = meta["round"], meta["samples_total"]
    own = [e for e in run._events if e.get("worker") == run.worker_id and e not in meta["membership"]]
    run._history, run._events = list(meta["history"]), list(meta["membership"]) + own


def _layouts(col: list[float], world: int) -> list[tuple[int, int | None]]:
    out = []
    for r in range(world):
        shards, index = col[0][r], col[1][r]
        if not (math.isfinite(shards) and shards == int(shards) and 0 <= shards <= _MAX_SHARDS
                and math.isfinite(index) and index == int(index) and -1 <= index < shards):
            raise ValueError(f"{_PREFIX}: rank {r} of the generation named share {index!r} of {shards!r} (a corrupted "
                             "or malicious member)")
        out.append((int(shards), None if index < 0 else int(index)))
    return out


def _optimizer_meta(run) -> dict:
    """What the outer optimizer keeps per tensor, by key: per element (a tensor of the piece's
    shape), or one value (a 0-d tensor, or a number)."""
    keys: dict[str, list] = {}
    for p in run._global:
        for k, v in run.outer_optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape:
                kind = ["tensor", str(v.dtype)]
            elif isinstance(v, torch.Tensor) and v.dim() == 0 and p.dim() > 0:
                kind = ["scalar", str(v.dtype)]
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                kind = ["number", type(v).__name__]
            elif isinstance(v, torch.Tensor) and p.dim() == 0:
                continue                       # (a 0-d parameter's state says nothing of the key's kind)
            else:
                raise ValueError(f"{_PREFIX}: the outer optimizer keeps {k!r} of a kind the state cannot be sharded "
                                 f"by ({type(v).__name__}): use shard_state=False")
            if keys.setdefault(k, kind) != kind:
                raise ValueError(f"{_PREFIX}: the outer optimizer keeps {k!r} as {keys[k]} and as {kind}")
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params" and _plain(v)}
              for g in run.outer_optimizer.param_groups]
    return {"keys": sorted([k, *kind] for k, kind in keys.items()), "groups": groups}


def _agree(why: str | None, what: str) -> None:
    """One exchange over the generation's group of whether each rank found a problem: this rank
    raises when it did (whatever the others sent: a member can add to any cell of the table), and
    when any other cell is not 0 (NaN included)."""
    flags = exchange_columns([1.0 if why else 0.0])[0]
    if why:
        raise ValueError(f"{_PREFIX}: {what}: {why}")
    if any(x != 0.0 for x in flags):
        raise ValueError(f"{_PREFIX}: {what}: another member found a problem (its error says which)")


def _plain(v) -> bool:
    """A hyperparameter that travels (a number, a flag, None, or a short tuple of numbers)."""
    if v is None or isinstance(v, (bool, int, float)):
        return True
    return isinstance(v, (tuple, list)) and len(v) <= 8 and all(isinstance(x, (int, float)) for x in v)


def _take_groups(opt, groups) -> str | None:
    """The holders' hyperparameters (lr, momentum, betas... as the run last set them) into ``opt``'s
    groups, matched by position; why not, or None."""
    if not (isinstance(groups, list) and len(groups) == len(opt.param_groups)
            and all(isinstance(g, dict) and len(g) <= 64 for g in groups)):
        return "the holders' outer optimizer has other parameter groups than this worker's"
    for mine, theirs in zip(opt.param_groups, groups):
        for k, v in theirs.items():
            if k in mine and k not in _NOT_MOVED and _plain(mine[k]) and not _same_kind(mine[k], v):
                return f"the holders' outer optimizer has {k}={v!r} where this worker's has {mine[k]!r}"
        for k, v in theirs.items():
            if k in mine and k not in _NOT_MOVED and _plain(mine[k]):
                mine[k] = tuple(v) if isinstance(mine[k], tuple) else v
    return None


# A group's settings that are how the optimizer runs, not the run's state: each worker's own.
_NOT_MOVED = {"params", "foreach", "fused", "capturable", "differentiable"}


def _same_kind(mine, theirs) -> bool:
    """``theirs`` (from JSON) can stand for ``mine``: the same kind of value, finite numbers."""
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    if mine is None or isinstance(mine, bool):
        return type(theirs) is type(mine)
    if isinstance(mine, (int, float)):
        return number(theirs)
    return (isinstance(theirs, list) and len(theirs) == len(mine) and all(number(x) for x in theirs))


# The dtypes a sharded outer optimizer's state may hold, and how many keys it may have.
_DTYPES = {"torch.float64", "torch.float32", "torch.bfloat16", "torch.float16", "torch.int64", "torch.int32",
           "torch.int16", "torch.int8", "torch.uint8", "torch.bool"}
_MAX_KEYS = 16


def _bad_keys(keys, state_of, held) -> str | None:
    """Why the announced keys of the outer optimizer's state are not usable here, or None."""
    if not (isinstance(keys, list) and len(keys) <= _MAX_KEYS
            and all(isinstance(k, list) and len(k) == 3 and all(isinstance(x, str) for x in k) for k in keys)):
        return f"the holders announced a malformed list of its keys (at most {_MAX_KEYS})"
    if len({k[0] for k in keys}) != len(keys):
        return "the holders announced a key twice"
    for name, kind, dtype in keys:
        if not ((kind in ("tensor", "scalar") and dtype in _DTYPES) or (kind == "number" and dtype in ("int", "float"))):
            return f"the holders announced {name!r} as a {kind} of {dtype}"
        for p in held or []:
            v = state_of.get(p, {}).get(name)
            if v is None:
                continue
            if kind == "tensor" and not (isinstance(v, torch.Tensor) and v.shape == p.shape and str(v.dtype) == dtype):
                return f"this holder keeps {name!r} as other than a {dtype} tensor of its parameter's shape"
            if kind != "tensor" and not ((isinstance(v, torch.Tensor) and v.dim() == 0)
                                         or (isinstance(v, (int, float)) and not isinstance(v, bool))):
                return f"this holder keeps {name!r} as other than one value"
    return None


def _dtype(name) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{_PREFIX}: the holders named {name!r} as a dtype")
    return dtype


def _number(v) -> float:
    """A per-tensor value of the outer optimizer as a float64 cell (NaN when it is not one: the
    receivers then agree that it did not move, rather than this rank raising alone)."""
    try:
        x = float(v.item() if isinstance(v, torch.Tensor) else v)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return math.nan
    return x


def _tensors_of(share: Share | None, pieces: list[torch.Tensor], starts: list[int]) -> list[range]:
    """The model tensors each of ``pieces`` (a share's, end to end in its order; each inside one
    of its ranges) holds elements of (``starts``: the tensors' flat offsets): one for a piece of
    a layout, none for an empty piece."""
    out, at = [], 0
    for piece in pieces:
        n = piece.numel()
        if n == 0 or share is None:
            out.append(range(0))
            continue
        lo = share.flat(at)
        out.append(range(bisect.bisect_right(starts, lo) - 1, bisect.bisect_left(starts, lo + n)))
        at += n
    return out


@torch.no_grad()
def load(run, inner, decision: dict) -> dict:
    """Collective over the generation's group, at its start: ``inner`` (the generation's DiLoCo)
    gets its share of the global parameters and of the outer optimizer's state from the holders
    of the run's state (``run._global``, ``run.outer_optimizer``: their shares,
    ``run._share``), and its start point; the members check that equal shares are equal.
    Returns what `resume` needs: every rank's new share, and the share of the round it carries."""
    members, me = decision["members"], dist.get_rank()
    world = len(members)
    holders = {members.index(h) for h in decision["holders"]}
    old = run._share if me in holders else None
    new = share_of(inner)
    whole = whole_fragments(inner)
    carry = run._share if run._carry is not None else None
    # (a share cut from other fragments than this generation's -- a checkpoint of a run with other
    # options -- lies elsewhere in the model: every rank refuses it)
    other = (old is not None or carry is not None) and run._whole is not None and \
        [tuple(f) for f in run._whole] != [tuple(f) for f in whole]
    table = exchange_columns([old[0] if old else 0, -1 if old is None or old[1] is None else old[1],
                              new[0], -1 if new[1] is None else new[1],
                              carry[0] if carry else 0, -1 if carry is None or carry[1] is None else carry[1],
                              1.0 if other else 0.0])
    olds, news, carries = _layouts(table[0:2], world), _layouts(table[2:4], world), _layouts(table[4:6], world)
    why = None
    if other:
        why = "this member holds a share cut from other fragments than this generation's (a checkpoint of a run " \
              "with other fragments)"
    elif (olds[me], news[me], carries[me]) != (old or (0, None), new, carry or (0, None)):
        why = "the exchange of shares did not carry this rank's as it sent them"
    elif any(x != 0.0 for x in table[6]):
        why = f"member(s) {[r for r in range(world) if table[6][r] != 0.0]} hold a share cut from other fragments"
    _agree(why, "the run's state cannot move between shares")
    sources = {r: olds[r] for r in sorted(holders) if olds[r][0] >= 1}
    moves = plan(sources, dict(enumerate(news)), whole)
    source = Share(whole, *old) if old is not None else None
    dest = Share(whole, *new)
    held = list(run._global) if old is not None else None
    into = list(inner._global)
    # As each chunk of the global parameters lands: its hash (`_check`) and the start point,
    # while the next chunks are on the wire (after the moves, two passes over the share took as
    # long as a third of the transfer of a 1 GB state).
    printed = [0]
    start = inner._start

    def landed(lo: int, at: int, values: torch.Tensor) -> None:
        printed[0] += _flat.additive_print([values], [lo])
        start[at:at + values.numel()].copy_(values)

    move(moves, dtype=inner._master, source=source, held=held, dest=dest, into=into, landed=landed)
    # The outer optimizer's state, key by key, from the first holder's list of keys.
    first = min((r for r, lay in sources.items() if intervals(whole, *lay)), default=None)
    if first is None:
        raise ValueError(f"{_PREFIX}: no member holds the run's state")
    problem = None
    try:
        announced = _optimizer_meta(run) if me == first else None
    except ValueError as e:                    # (the others must not wait for metadata that never comes)
        announced, problem = {"keys": []}, e
    meta = _broadcast_meta(announced, first)
    keys = meta.get("keys")
    state_of = run.outer_optimizer.state if old is not None else {}
    # Every rank checks what was announced (and a holder that its own state is of that kind), then
    # the group agrees, so that no rank waits in a move that another left.
    why = str(problem) if problem is not None else _bad_keys(keys, state_of, held)
    _agree(why, "the run's outer optimizer state cannot move between shares")
    # Per element: the tensors (Adam's moments); per tensor, in one exchange of the tensors' values
    # among the holders: whether a tensor has state, and the values of one (Adam's step).
    values: dict[str, list[torch.Tensor]] = {}
    for name, kind, dtype_name in keys:
        if kind != "tensor":
            continue
        dtype = _dtype(dtype_name)
        mine = [state_of[p][name].reshape(-1) if name in state_of.get(p, {}) else torch.zeros(p.numel(), dtype=dtype)
                for p in held] if held is not None else None
        values[name] = [torch.empty(q.numel(), dtype=dtype) for q in into]
        move(moves, dtype=dtype, source=source, held=mine, dest=dest, into=values[name])
    starts = _offsets(p.numel() for p in inner._model_params)
    ones = [k for k in keys if k[1] != "tensor"]
    column = [-1.0] * (len(starts) - 1) * (1 + len(ones))    # per tensor: -1 (no piece of it here)
    if held is not None and me in holders:
        for p, span in zip(held, _tensors_of(source, held, starts)):
            entry = state_of.get(p, {})
            for t in span:
                column[t] = 1.0 if entry else 0.0
                for k, (name, _, _) in enumerate(ones):
                    column[(1 + k) * (len(starts) - 1) + t] = _number(entry[name]) if name in entry else math.nan
    table = exchange_columns(column)
    opt = inner.outer_optimizer
    # (a SUM of columns: any member could add to any cell; each rank checks that its own came back
    # as it sent it, and that the non-holders' say nothing)
    why = None
    if not all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip((row[me] for row in table), column)):
        why = "the exchange of the outer optimizer's per-tensor values did not carry this rank's as it sent them"
    elif any(row[r] != -1.0 for row in table for r in range(world) if r not in holders):
        why = "a member that holds none of the run's state sent per-tensor values of the outer optimizer"
    why = why or _take_groups(opt, meta.get("groups"))
    entries = {}
    for i, (q, span) in enumerate(zip(into, _tensors_of(dest, into, starts))):
        if why or not span:
            continue
        # (every holder of a piece of the tensor: a fragment holds whole tensors, so they stepped it together)
        givers = [(t, r) for t in span for r in holders if table[t][r] != -1.0]
        have = {table[t][r] for t, r in givers}
        if have != {1.0}:
            if have != {0.0}:
                why = "the holders do not agree on (or do not say) whether the outer optimizer has state for a tensor"
            continue
        entry = {name: values[name][i].view(q.shape) for name, kind, _ in keys if kind == "tensor"}
        for k, (name, kind, dtype_name) in enumerate(ones):
            got = {table[(1 + k) * (len(starts) - 1) + t][r] for t, r in givers}
            v = next(iter(got))
            if len(got) != 1 or not math.isfinite(v):
                why = f"the holders' outer optimizer state has several values (or none) of {name!r} in one tensor"
                continue
            dtype = _dtype(dtype_name) if kind == "scalar" else None
            integral = dtype_name == "int" if dtype is None else not (dtype.is_floating_point or dtype.is_complex)
            if integral and (v != int(v) or (dtype == torch.bool and v not in (0.0, 1.0))):
                why = f"the holders' value of {name!r} ({v!r}) is not a value of its dtype {dtype_name}"
                continue
            try:
                entry[name] = torch.tensor(v, dtype=dtype) if dtype is not None else int(v) if integral else v
            except (RuntimeError, ValueError, OverflowError) as e:     # (an int beyond its dtype's range)
                why = f"the holders' value of {name!r} does not fit its dtype {dtype_name} ({e})"
        entries[i] = entry
    # (agreed, so that every rank raises, rather than the others waiting for this one in `_check`)
    _agree(why, "the run's outer optimizer state did not move between shares")
    for i, entry in entries.items():
        opt.state[into[i]] = entry
    whole_print = _check(inner, news, printed[0] % (1 << 64))
    last = run._history[-1] if run._history else None
    if last is not None and last.get("fingerprint", 0) is None and last.get("round") == decision["round"]:
        last["fingerprint"] = whole_print      # (a failure kept the round's from being summed: `_record`)
    return {"news": news, "carries": {r: c for r, c in enumerate(carries) if c[0] >= 1}, "whole": whole}


@torch.no_grad()
def resume(inner, delta: torch.Tensor | None, keep: list[bool], labels: list[int], shares: dict) -> list[bool]:
    """Collective over the generation's group (`carry.resume_round`, sharded): the replicas of the
    workers that keep their round become the new global parameters less what they carry (each
    rank carries it, ``delta``, on its old share: the worker's ranks move it onto their new shares),
    the others' the new global parameters; then each worker's ranks exchange their shares of the
    replica. A worker whose ranks' old shares do not cover the model (one of them is gone) does
    not keep its round. Returns ``keep`` so corrected (the same on every rank)."""
    keep, me, whole = list(keep), dist.get_rank(), shares["whole"]
    news, carries = shares["news"], shares["carries"]
    moves = []
    for label in dict.fromkeys(labels):
        ranks = [r for r, x in enumerate(labels) if x == label]
        if not keep[ranks[0]]:
            continue
        if any(r not in carries for r in ranks):
            for r in ranks:
                keep[r] = False
            continue
        try:
            moves += plan({r: carries[r] for r in ranks if r in carries}, {r: news[r] for r in ranks}, whole)
        except ValueError:                     # (what it carries is no longer whole)
            for r in ranks:
                keep[r] = False
    carried = None
    if keep[me] and me in carries and delta is not None:
        carried = [torch.empty(q.numel(), dtype=inner._master) for q in inner._global]
        move(moves, dtype=inner._master, source=Share(whole, *carries[me]), held=[delta],
             dest=Share(whole, *news[me]), into=carried)
    else:
        move(moves, dtype=inner._master, source=None, held=None, dest=None, into=None)
    if carried is not None:
        _flat.load(inner._params, [g.detach().reshape(-1) - d for g, d in zip(inner._global, carried)])
    else:
        _flat.load(inner._params, inner._global)
    inner._share(range(len(inner._fragments)))
    return keep


def _check(inner, news: list[tuple[int, int | None]], total: int) -> int:
    """Ranks that hold the same share hold the same bits, or every rank raises (``total``: the
    `flat.additive_print` of this rank's share of the global parameters). Returns the rounds'
    hash of the whole global parameters (`DiLoCo._global_print`), from the shares."""
    sent = [float(total & 0xFFFFFFFF), float(total >> 32)]
    table = exchange_columns(sent)
    # (a SUM of columns: a member that added to another's cells could make shares that differ
    # look equal; each rank checks its own, and they agree before comparing)
    me = dist.get_rank()
    _agree(None if [table[0][me], table[1][me]] == sent else "the exchange of the shares' hashes did not carry this "
           "rank's as it sent it", "the shares of the global parameters cannot be compared")
    shards_now = share_of(inner)[0]
    seen: dict[int, tuple[float, float]] = {}
    for r, (shards, index) in enumerate(news):
        if index is None or shards != shards_now:
            continue
        mine = (table[0][r], table[1][r])
        if not all(math.isfinite(x) and x == int(x) and 0 <= x < 2 ** 32 for x in mine) \
                or seen.setdefault(index, mine) != mine:
            raise ValueError(f"{_PREFIX}: the members' shares {index} of {shards} of the global parameters differ after "
                             "the state moved: a bug, please report it")
    if sorted(seen) != list(range(shards_now)):
        raise ValueError(f"{_PREFIX}: the generation's members do not hold every share of the global parameters")
    total = sum(int(lo) + (int(hi) << 32) for lo, hi in seen.values())
    return _flat.print_bits(total)
