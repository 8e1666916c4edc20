"""Joining early: the state a round started from, offered by the members through the store in
chunks as soon as a joiner asks, and taken by the joiner, which trains in that round (a part of
`ElasticDiLoCo`)."""
from __future__ import annotations

import hashlib
import json
import math
import threading
import time

import torch

from hetcomm.train.elastic.common import (_PREFIX, _fingerprint, _Poll, _to_json, _from_json, _next_decided,
                                          _read_decision, _read_ended, _read_int)
from hetcomm.train.membership import StoreUnreachable


_CHUNK = 4 << 20              # bytes per store value of an offer (the libuv TCPStore refuses over 8 MiB)


def _offer_layout(total: int, shards: int, chunk: int = _CHUNK) -> list[tuple[int, int, int]]:
    """An offer of ``total`` bytes in ``shards`` byte ranges: (lo, hi, values of ``chunk`` bytes)."""
    out = []
    for i in range(shards):
        lo, hi = total * i // shards, total * (i + 1) // shards
        out.append((lo, hi, -(-(hi - lo) // chunk)))
    return out


def _byte_range(raw: list[torch.Tensor], lo: int, hi: int) -> bytes:
    """Bytes [lo, hi) of the concatenation of ``raw`` (uint8 tensors), copying only those."""
    parts, at = [], 0
    for r in raw:
        a, b = max(lo, at), min(hi, at + r.numel())
        if a < b:
            parts.append(r[a - at:b - at].numpy().tobytes())
        at += r.numel()
    return b"".join(parts)


def _delete_offer(keys, rnd: int, layout: list[tuple[int, int, int]], only: int | None = None) -> None:
    """Deletes an offer's keys: every shard's (a dead member's too), or only shard ``only``."""
    for i, (_, _, chunks) in enumerate(layout):
        if only is not None and i != only:
            continue
        keys.delete(f"snap/r{rnd}/{i}/sum")
        for k in range(chunks):
            keys.delete(f"snap/r{rnd}/{i}/{k}")
    if only is None:
        keys.delete(f"snap/r{rnd}/meta")


_PLAIN_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def _offer_problem(meta, global_bytes: int) -> str | None:
    """What is wrong with an offer's metadata (read from the store: a store writer's, without an
    out-of-band secret), before anything is allocated for it; None when it is well formed. Its
    bytes are the global parameters and an outer optimizer state of at most four times them."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    if not isinstance(meta.get("fingerprint"), (int, float)) or isinstance(meta.get("fingerprint"), bool):
        return "no fingerprint"
    ints = {k: meta.get(k) for k in ("round", "epoch", "shards", "bytes", "chunk", "globals", "samples_total")}
    if not all(isinstance(v, int) and v >= 0 for v in ints.values()):
        return "round, epoch, shards, bytes, chunk, globals and samples_total must be integers"
    if ints["chunk"] != _CHUNK or not 1 <= ints["shards"] <= 4096 or ints["globals"] < 1 or ints["bytes"] > 5 * global_bytes + (1 << 20):
        return f"{ints['bytes']} bytes in {ints['shards']} shards of chunk {ints['chunk']}"
    tensors = meta.get("tensors")
    if not (isinstance(tensors, list) and len(tensors) >= ints["globals"]
            and all(isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and isinstance(t[2], int)
                    and isinstance(t[1], list) and all(isinstance(d, int) and d >= 0 for d in t[1]) for t in tensors)):
        return "its tensors are not [dtype, shape, bytes]"
    for name, shape, nbytes in tensors:
        dtype = getattr(torch, name.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype in _PLAIN_INTS) \
                or math.prod(shape) * dtype.itemsize != nbytes:
            return f"a tensor of dtype {name[:40]!r}, shape {shape[:8]} cannot have {nbytes} bytes"
    if sum(t[2] for t in tensors) != ints["bytes"]:
        return "its tensors do not add up to its bytes"
    if not (all(isinstance(meta.get(k), list) for k in ("history", "membership"))
            and all(isinstance(r, dict) for k in ("history", "membership") for r in meta[k])
            and isinstance(meta.get("budgets"), dict) and isinstance(meta.get("skeleton"), dict)
            and all(isinstance(v, int) and v >= 0 for v in meta["budgets"].values())):
        return "its history, membership, budgets or skeleton are malformed"
    return None


class EarlyJoin:
    """Offers of the round's starting state, and the joiner's side."""

    # ---- joining early: the state a round started from, offered through the store ------------

    def _offer_state(self) -> None:
        """A worker asked to join: offer it the state this round started from (the global
        parameters, the outer optimizer's state, the round count and history) so that it can
        train in the round in progress instead of waiting for its end. Every member of the last
        decision puts one shard of the raw bytes on the store (the transfer is spread over them),
        in values of at most `_CHUNK` bytes, sent from a thread; once per round."""
        decision = self._decision
        if (not self._holds or self._outcome != "commit" or decision is None or self._offered == self._round
                or self._me not in decision["members"] or (self._uploader and self._uploader.is_alive())):
            return
        begin = time.perf_counter()
        self._offered = rnd = self._round
        members = decision["members"]
        n, i = len(members), members.index(self._me)
        extra: list[torch.Tensor] = []
        skeleton = self._skeleton(self.outer_optimizer.state_dict(), extra)
        tensors = [g.detach() for g in self._global] + [t.detach() for t in extra]
        raw = [t.reshape(-1).contiguous().view(torch.uint8) for t in tensors]
        layout = _offer_layout(sum(r.numel() for r in raw), n)
        lo, hi, chunks = layout[i]
        mine = _byte_range(raw, lo, hi)
        last = self._history[-1] if self._history else None
        fingerprint = (last["fingerprint"] if last and last["round"] == rnd
                       else _fingerprint(self._flatten_global()))
        meta = {"round": rnd, "epoch": decision["epoch"], "shards": n, "bytes": layout[-1][1], "chunk": _CHUNK,
                "skeleton": _to_json(skeleton), "globals": len(self._global), "fingerprint": fingerprint,
                "tensors": [[str(t.dtype), list(t.shape), r.numel()] for t, r in zip(tensors, raw)],
                "samples_total": self._samples_total, "history": list(self._history),
                "membership": list(self._events), "budgets": dict(self._budgets), "codec": self._codec_name,
                "shapes": [list(g.shape) for g in self._global]}
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            self._log(f"cannot offer the state to joiners (the outer optimizer's state is not plain data: {e}); "
                      "they are admitted at the round's end")
            return
        if self._snap_keys is None:
            self._snap_keys = self._keys.clone()
        keys = self._snap_keys
        self._offers.append((rnd, layout, i))     # withdrawn (every shard of it) once the round is over

        def upload() -> None:
            try:
                for k in range(chunks):
                    keys.set_bytes(f"snap/r{rnd}/{i}/{k}", mine[k * _CHUNK:(k + 1) * _CHUNK])
                keys.set(f"snap/r{rnd}/{i}/sum", hashlib.blake2b(mine, digest_size=16).hexdigest())
                keys.first(f"snap/r{rnd}/meta", meta)
                if self._round == rnd:
                    keys.set("snap/latest", rnd)
                if self._round > rnd or self._closed:      # over while it was being sent
                    _delete_offer(keys, rnd, layout, None if self._round > rnd else i)
            except StoreUnreachable as e:
                self._log(f"could not offer the state of round {rnd} to a joiner: {e}")
        self._uploader = threading.Thread(target=upload, name="hetcomm-elastic-offer", daemon=True)
        self._uploader.start()
        self._count("sync", begin)

    def _withdraw_offers(self, everything: bool = False) -> None:
        """Deletes the offers of rounds that are over (all, when closing): every shard, a dead
        member's too (a joiner that loaded one is past it; one still reading falls back)."""
        old = [o for o in list(self._offers) if everything or o[0] < self._round]
        if old and self._keys is not None:
            for rnd, layout, i in old:
                self._offers.remove((rnd, layout, i))
                # the round in progress (closing): only its own shard; the others withdraw theirs,
                # and a joiner finds the offer incomplete and joins at the boundary
                _delete_offer(self._keys, rnd, layout, None if rnd < self._round else i)
        if self._snapped and (everything or self._holds):
            self._snapped = False
            self._keys.delete(f"snapped/{self._me}")

    def _take_offer(self, index: int, epoch: int, last: dict) -> bool:
        """A joiner, waiting (``last``: the latest decision, of epoch ``epoch - 1``): if the members
        offer the state that decision committed, load it and train from it (True); `_early_step`
        then watches for the round's decision."""
        keys = self._keys
        try:
            committed = keys.peek(f"e{epoch - 1}/outcome") == "commit"
        except ValueError:
            committed = False
        rnd = _read_int(keys, "snap/latest")
        if not committed or rnd is None:
            return False
        if rnd == self._offer_refused:
            return False
        reader = keys.clone()
        if reader is not keys:
            reader.set_timeout(max(2.0, self._heartbeat))    # (an offer withdrawn meanwhile: no long wait)
        begin = time.perf_counter()
        try:
            meta = reader.peek(f"snap/r{rnd}/meta")
            if meta is None:
                return False
            why = _offer_problem(meta, sum(g.numel() * g.element_size() for g in self._global))
            if why:
                self._offer_refused = rnd
                self._log(f"the state offered for round {rnd} is malformed ({why}): waiting for the boundary")
                return False
            if meta["epoch"] != epoch - 1:
                return False                  # the state of an earlier decision
            if not all(reader.has(f"snap/r{rnd}/{i}/sum") for i in range(meta["shards"])):
                return False                  # not all there yet (or a member died offering it)
            if meta.get("shapes") != [list(g.shape) for g in self._global] or meta.get("codec") != self._codec_name:
                self._offer_refused = rnd     # another model: the decision refuses this worker
                return False
            buf = bytearray(meta["bytes"])
            for i, (lo, hi, chunks) in enumerate(_offer_layout(meta["bytes"], meta["shards"], meta["chunk"])):
                shard = b"".join(reader.get_bytes(f"snap/r{rnd}/{i}/{k}") for k in range(chunks))
                if len(shard) != hi - lo or (hashlib.blake2b(shard, digest_size=16).hexdigest()
                                             != reader.get(f"snap/r{rnd}/{i}/sum")):
                    self._offer_refused = rnd
                    self._log(f"the state offered for round {rnd} arrived damaged: waiting for the boundary")
                    return False
                buf[lo:hi] = shard
        except (StoreUnreachable, ValueError):
            return False                      # withdrawn or replaced meanwhile, or the store died (the next call says)
        finally:
            del reader
        flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        pieces, at = [], 0
        for dtype, shape, nbytes in meta["tensors"]:
            pieces.append(flat[at:at + nbytes].clone().view(getattr(torch, dtype.removeprefix("torch."))).view(shape))
            at += nbytes
        if [list(p.shape) for p in pieces[:meta["globals"]]] != [list(g.shape) for g in self._global] \
                or _fingerprint(torch.cat([p.reshape(-1).to(self._master) for p in pieces[:meta["globals"]]])) \
                != meta["fingerprint"]:
            self._offer_refused = rnd
            self._log(f"the state offered for round {rnd} does not match its fingerprint: waiting for the boundary")
            return False
        try:
            self.outer_optimizer.load_state_dict(self._fill(_from_json(meta["skeleton"]), pieces[meta["globals"]:]))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, RuntimeError) as e:
            self._offer_refused = rnd         # another outer optimizer: the decision refuses this worker
            self._log(f"cannot load the outer optimizer's state offered for round {rnd} ({e}): waiting for the boundary")
            return False
        with torch.no_grad():
            for g, piece in zip(self._global, pieces):
                g.copy_(piece)
        self._round, self._samples_total = meta["round"], meta["samples_total"]
        own = [e for e in self._events if e.get("worker") == self.worker_id and e not in meta["membership"]]
        self._history, self._events = list(meta["history"]), list(meta["membership"]) + own
        run = {k: meta["budgets"].get(k, 0) for k in ("max_rounds", "max_samples")}
        if {k: self._budgets.get(k, 0) for k in run} != run:
            self._log(f"the run's budgets are {run} (0 = none), not this worker's {self._budgets}: taking the run's")
            self._budgets = run
        self._start = self._flatten_global()
        self._load_global()
        self._holds = False                   # not a member until a decision names it
        keys.set(f"snapped/{self._me}", rnd)
        self._snapped = True
        self._count("sync", begin)
        if _read_decision(keys, epoch) is not None:
            return False                      # the round ended meanwhile: its decision says what next
        self._early = {"index": index, "epoch": epoch, "round": rnd, "watched": last["members"],
                       "looked": 0.0, "began": time.perf_counter()}
        self._log(f"loaded the state of round {rnd} offered by {meta['shards']} members "
                  f"({len(buf) / 1e6:.1f} MB): training in round {rnd + 1} until its decision")
        return True

    def _round_share(self) -> float:
        """The part of the round an early joiner trained: its steps over ``steps``, or its time
        over ``round_seconds`` (`_weights`)."""
        if self._round_seconds is None:
            return min(1.0, self._r_steps / self._steps)
        return min(1.0, (time.perf_counter() - self._early["began"]) / self._round_seconds)

    def _early_step(self, over: bool) -> bool:
        """After each step of a worker that joined early: once the round's decision is out (waiting
        for it if this worker's round is over), take part in it as a holder of the state it
        loaded, its steps weighed by the part of the round it trained; if the decision does not name it a holder,
        discard the steps and be admitted as usual. Returns whether a synchronisation took place."""
        early, keys = self._early, self._keys
        poll, begin = _Poll(), time.perf_counter()
        while True:
            decision = _read_decision(keys, early["epoch"])
            if decision is not None:
                break
            now = time.monotonic()
            if over or now - early["looked"] >= self._heartbeat:
                early["looked"] = now
                self._pulse.check()
                self._raise_if_refused(keys)
                if _read_ended(keys) is not None or _next_decided(keys, early["epoch"]) != early["epoch"]:
                    decision = None              # (its decision deleted: the round went on without it)
                    break
                if all(self._pulse.quiet(m, self._timeout) for m in early["watched"]):
                    raise RuntimeError(f"{_PREFIX}: every member of epoch {early['epoch'] - 1} "
                                       f"({self._names(early['watched'])}) is gone, and the run's state with them: "
                                       "restart the job from checkpoints (load_state_dict)")
            if not over:
                return False
            poll()
        if over:
            self._count("idle", begin)
        if decision is not None and self._me in decision["holders"]:
            self._r_share = self._round_share()
            self._early = None
            self._end_round(admitted=decision)
            if self._holds and self._history and self._history[-1]["round"] == decision["round"] + 1:
                self._early_joins += 1        # it contributed to the round it joined
            return True
        # left out, or named without the state it loaded (the round moved on): discard the steps
        self._early = None
        self._log(f"the round it joined early went on without it ({self._r_steps} steps discarded): "
                  "joining at the boundary")
        self._reset_round()
        self._admit(resume=(early["index"], early["epoch"]))
        if self._early is None and not self._stopped:
            self._check_budgets()
        self._reset_round()
        return self._early is None and not self._stopped
