"""A generation of an elastic run's members: its process group, the transfer of the run's state
to members without it, and the epoch's table (fingerprints, holders, budgets, configuration)."""
from __future__ import annotations

import datetime
import json
import time

import torch
import torch.distributed as dist

from hetcomm.train.elastic.common import (_PREFIX, _PRINT, _HOLDS, _MAX_ROUNDS, _MAX_SAMPLES, _CONFIG, _digest, _fingerprint,
                                          _to_json, _from_json)
from hetcomm.train.partition import exchange_columns


# The most bytes of the metadata a joiner accepts from the holders (round, history, membership
# events, the outer optimizer's layout): checked before it allocates them.
_MAX_META_BYTES = 256 << 20
_ADDRESS_BYTES = 300          # a liveness address as published (JSON "host:port"), at most


def _broadcast_meta(meta: dict | None, src: int, group=None) -> dict:
    """The first holder's metadata, on every member, as JSON over the group (never unpickled: a
    peer's bytes could run code), its length first. A process that got into the group without
    being a member (a store writer can redirect a Gloo group's rendezvous) can send garbage: it
    ends in a ValueError, not in a huge allocation."""
    sending, problem = dist.get_rank() == src, None
    try:
        raw = json.dumps(_to_json(meta)).encode() if sending else b""
    except (TypeError, ValueError) as e:         # the receivers must not wait for bytes that never come
        raw, problem = b"", e
    length = torch.tensor([len(raw)], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    n = int(length.item())
    if problem is not None:
        raise ValueError(f"{_PREFIX}: cannot send the run's state to a joiner: the outer optimizer's state is not "
                         f"plain data ({problem})") from problem
    if not 0 < n <= _MAX_META_BYTES:
        raise ValueError(f"{_PREFIX}: this worker cannot join: the holders announced {n} bytes of metadata "
                         f"(at most {_MAX_META_BYTES})")
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if sending else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return meta if sending else _decode_meta(buf.numpy().tobytes())


def _decode_meta(raw: bytes) -> dict:
    try:
        meta = _from_json(json.loads(raw))
    except (ValueError, TypeError, RecursionError) as e:
        raise ValueError(f"{_PREFIX}: this worker cannot join: the holders' metadata is malformed ({e})") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{_PREFIX}: this worker cannot join: the holders' metadata is not a JSON object")
    return meta


class Generation:
    """The generation's group and what runs over it."""

    _state_deferred: dict | None = None      # the decision whose transfer runs later (`ElasticRun`)
    _holders_print: float | None = None      # the holders' fingerprint of the global parameters

    # ---- the generation's group --------------------------------------------------------------

    def _form_group(self, decision: dict) -> None:
        self._destroy_group()
        # The decision's digest in the prefix: members that read different decisions for the same
        # generation (a store writer deleted one and a second was written) never meet in one group;
        # their group formation fails and the epoch is redone.
        digest = _digest(decision)
        store = dist.PrefixStore(f"{self._keys.root}g{decision['gen']}-{digest}", self._group_store.store)
        # torch names the default group after a counter (its keys on the store carry the name)
        # that a failed init_process_group advances and only destroy_process_group resets: put
        # it back, or this worker's next group would wait on keys its peers never write.
        count = dist.distributed_c10d._world.group_count
        try:
            dist.init_process_group(self._backend, store=store, rank=decision["members"].index(self._me),
                                    world_size=len(decision["members"]),
                                    timeout=datetime.timedelta(seconds=self._collective_timeout))
        except BaseException:
            if not dist.is_initialized():
                dist.distributed_c10d._world.group_count = count
            raise
        self._gen = decision["gen"]
        self._share_liveness(decision["members"])

    def _share_liveness(self, members: list[str]) -> None:
        """Every member's liveness address, over the generation's group (with the secret its links
        are authenticated: no store writer can forge or hide what they carry), to the heartbeat
        (`Pulse.learn`). A few bytes a generation."""
        mine = torch.zeros(_ADDRESS_BYTES, dtype=torch.uint8)
        raw = self._pulse.address[:_ADDRESS_BYTES]
        mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        rows = [torch.empty_like(mine) for _ in members]
        dist.all_gather(rows, mine)
        self._pulse.learn({m: bytes(r.tolist()).rstrip(b"\0") for m, r in zip(members, rows)})

    def _destroy_group(self) -> None:
        self._gen = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a failed group: it is being left behind anyway
                pass

    def _transfer(self, decision: dict) -> None:
        """The holders send the run's state to the members without it, one shard each."""
        sent = self._state_to_send(clone=False) if self._me in decision["holders"] else None
        received = self._exchange_state(decision, sent, None)
        if received is not None:
            self._take_state(*received)
        self._phases.mark("state")

    def _state_to_send(self, clone: bool) -> tuple[dict, list[torch.Tensor]]:
        """A holder's metadata and tensors of the run's state (``clone``: copies, for a transfer
        that runs while the state moves on)."""
        tensors: list[torch.Tensor] = []
        skeleton = self._skeleton(self.outer_optimizer.state_dict(), tensors)
        tensors = list(self._global) + tensors
        if clone:
            tensors = [t.detach().clone() for t in tensors]
        meta = {"skeleton": skeleton, "round": self._round, "samples_total": self._samples_total,
                "history": list(self._history), "membership": list(self._events), "codec": self._codec_name,
                "shapes": [list(g.shape) for g in self._global],
                "sizes": [t.numel() for t in tensors], "dtypes": [str(t.dtype) for t in tensors]}
        return meta, tensors

    def _exchange_state(self, decision: dict, sent: tuple[dict, list[torch.Tensor]] | None,
                        group) -> tuple[dict, list[torch.Tensor]] | None:
        """Over ``group`` (None: the generation's): a holder sends ``sent`` (`_state_to_send`), one
        shard per holder; a member without the state gets (metadata, tensors), checked."""
        members, holders = decision["members"], decision["holders"]
        sources = [members.index(h) for h in holders]
        if group is not None:                    # (broadcast takes the job's global ranks)
            sources = [dist.get_global_rank(group, s) for s in sources]
        mine = sent is not None
        meta, tensors = sent if mine else (None, [])
        meta = _broadcast_meta(meta, sources[0], group)
        if not mine:
            self._check_meta(meta)
        # Each dtype's tensors as one vector of raw bytes (any dtype travels, whatever the backend
        # supports), cut in one shard per holder: each holder sends its shard to the group, not
        # through the store. A holder converts to the dtype the first holder named: a worker that
        # joined once may hold the optimizer's state in other dtypes than the founders
        # (load_state_dict casts).
        sizes, pieces = meta["sizes"], [None] * len(meta["sizes"])
        for name in dict.fromkeys(meta["dtypes"]):
            dtype = getattr(torch, name.removeprefix("torch."))
            index = [i for i, d in enumerate(meta["dtypes"]) if d == name]
            if mine:
                flat = torch.cat([tensors[i].detach().reshape(-1).to(dtype) for i in index])
            else:
                flat = torch.empty(sum(sizes[i] for i in index), dtype=dtype)
            raw = flat.view(torch.uint8) if flat.numel() else flat
            for src, shard in zip(sources, raw.tensor_split(len(sources))):
                if shard.numel():
                    dist.broadcast(shard, src=src, group=group)
            for i, piece in zip(index, flat.split([sizes[i] for i in index])):
                pieces[i] = piece
        return None if mine else (meta, pieces)

    def _take_state(self, meta: dict, pieces: list[torch.Tensor]) -> None:
        """A member without the run's state loads what the holders sent (`_exchange_state`)."""
        with torch.no_grad():
            for g, piece in zip(self._global, pieces):
                g.copy_(piece.view(g.shape))
        try:
            state = self._fill(meta["skeleton"], list(pieces[len(self._global):]))
            self.outer_optimizer.load_state_dict(state)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, RuntimeError) as e:
            raise ValueError(f"{_PREFIX}: this worker cannot join: the holders' outer optimizer state does not "
                             f"load into this worker's ({type(e).__name__}: {e})") from e
        self._restore_dtypes(state)
        self._round, self._samples_total = meta["round"], meta["samples_total"]
        own = [e for e in self._events if e.get("worker") == self.worker_id and e not in meta["membership"]]
        self._history, self._events = list(meta["history"]), list(meta["membership"]) + own
        self._load_global()

    def _check_meta(self, meta) -> None:
        """A joiner's checks of what the holders announce, before it allocates anything: a
        ValueError (this worker cannot join) rather than an IndexError or a huge allocation."""
        def refuse(why: str):
            raise ValueError(f"{_PREFIX}: this worker cannot join: {why}")

        if not isinstance(meta, dict) or "dtypes" not in meta:
            refuse("the holders of the run's state run another version of hetcomm (run the same version on every "
                   "worker)")
        shapes = [list(g.shape) for g in self._global]
        if meta.get("shapes") != shapes or meta.get("codec") != self._codec_name:
            refuse(f"the run's model has parameter shapes {meta.get('shapes')} and {meta.get('codec')}; this "
                   f"worker's {shapes} and {self._codec_name}")
        if not (all(isinstance(meta.get(k), int) and not isinstance(meta[k], bool) and meta[k] >= 0
                    for k in ("round", "samples_total"))
                and all(isinstance(meta.get(k), list) and all(isinstance(r, dict) for r in meta[k])
                        for k in ("history", "membership"))
                and isinstance(meta.get("skeleton"), dict)):
            refuse("the holders announced a malformed state (round, samples, history or membership)")
        sizes, dtypes = meta.get("sizes"), meta.get("dtypes")
        if not (isinstance(sizes, list) and isinstance(dtypes, list) and len(sizes) == len(dtypes)
                and len(sizes) <= 16 * len(self._global) + 64
                and all(isinstance(n, int) and n >= 0 for n in sizes) and all(isinstance(d, str) for d in dtypes)):
            refuse("the holders announced a malformed state (sizes and dtypes)")
        if sizes[:len(self._global)] != [g.numel() for g in self._global]:
            refuse("the holders announced global parameters of other sizes than this worker's model")
        if any(not isinstance(getattr(torch, d.removeprefix("torch."), None), torch.dtype) for d in dtypes):
            refuse(f"the run's state holds tensors of an unknown dtype ({sorted(set(dtypes))})")
        # The outer optimizer's state: a few tensors of the parameters' sizes (Adam: two) and scalars.
        if sum(sizes[len(self._global):]) > 4 * sum(sizes[:len(self._global)]) + 1024 * len(sizes):
            refuse(f"the holders announced an outer optimizer state of {sum(sizes[len(self._global):])} elements "
                   f"for {sum(sizes[:len(self._global)])} parameters")

    def _restore_dtypes(self, state: dict) -> None:
        """Puts back the dtypes the holders keep the optimizer's state in (`load_state_dict` casts
        it to the parameters' dtype), so that the joiner's next outer step is theirs bit for bit."""
        saved = [i for group in state["param_groups"] for i in group["params"]]
        params = [p for group in self.outer_optimizer.param_groups for p in group["params"]]
        for i, p in zip(saved, params):
            mine, theirs = self.outer_optimizer.state.get(p, {}), state["state"].get(i, {})
            for key, value in theirs.items():
                if isinstance(value, torch.Tensor) and isinstance(mine.get(key), torch.Tensor) \
                        and mine[key].dtype != value.dtype:
                    mine[key] = mine[key].to(value.dtype)

    @classmethod
    def _skeleton(cls, obj, tensors: list):
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return {"__tensor__": len(tensors) - 1, "shape": list(obj.shape), "dtype": str(obj.dtype)}
        if isinstance(obj, dict):
            return {k: cls._skeleton(v, tensors) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(cls._skeleton(v, tensors) for v in obj)
        return obj

    @classmethod
    def _fill(cls, obj, pieces: list):
        if isinstance(obj, dict) and "__tensor__" in obj:
            dtype = getattr(torch, obj["dtype"].removeprefix("torch."))
            return pieces[obj["__tensor__"]].view(obj["shape"]).to(dtype).clone()
        if isinstance(obj, dict):
            return {k: cls._fill(v, pieces) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(cls._fill(v, pieces) for v in obj)
        return obj

    def _check_table(self, decision: dict, column: list[float]) -> None:
        """The epoch's table, every member's column, and what it checks: the holders' global
        parameters are equal (fingerprints), and so are their budgets and configurations."""
        col = list(column)
        holds = self._me in decision["holders"]
        # (a member whose state comes later has nothing to show: 0, not compared)
        col[_PRINT] = self._epoch_print() if holds or self._state_deferred is None else 0.0
        col[_HOLDS] = 1.0 if holds else 0.0
        table = exchange_columns(col)
        self._agree_on_budgets(decision, table)
        # A transfer that runs after the epoch (`_state_deferred`): the members without the state
        # check what they receive against the holders' fingerprint (`_holders_print`).
        compared = [(m, p) for m, p, h in zip(decision["members"], table[_PRINT], table[_HOLDS])
                    if h or self._state_deferred is None]
        self._holders_print = next((p for p, h in zip(table[_PRINT], table[_HOLDS]) if h), None)
        if len({p for _, p in compared}) > 1:
            raise ValueError(f"{_PREFIX}: round {decision['round']}: the members' global parameters differ "
                             f"(fingerprints {dict(compared)}): "
                             "a bug, please report it -- or a store writer deleted a decision or an outcome "
                             "that some members had read (docs/security.md)")
        self._leave_out_offenders(decision, table)

    def _epoch_print(self) -> float:
        """What the epoch compares over the members that hold the run's state."""
        return float(_fingerprint(self._flatten_global()))

    def _leave_out_offenders(self, decision: dict, table: list[list[float]]) -> None:
        """A member whose compression or model size is not the run's stops with a ValueError
        saying why; the others abort the attempt and redo it without it. When every member is at
        fault, every member raises."""
        configs = {c for c, h in zip(table[_CONFIG], table[_HOLDS]) if h}
        if len(configs) > 1:
            raise ValueError(f"{_PREFIX}: round {decision['round']}: the workers that hold the run's state use "
                             "different compress/block settings or model sizes; every worker must use the same")
        offenders = {m: "its compress/block settings or model size are not the run's"
                     for m, config in zip(decision["members"], table[_CONFIG]) if configs and config not in configs}
        if not offenders:
            return
        if self._me in offenders:
            raise ValueError(f"{_PREFIX}: round {decision['round']}: this worker stops: {offenders[self._me]}"
                             + ("" if len(offenders) == len(decision["members"]) else "; the others go on without it"))
        raise RuntimeError("; ".join(f"{self._names([m])} left out: {why}" for m, why in offenders.items()))

    def _agree_on_budgets(self, decision: dict, table: list[list[float]]) -> None:
        """The run's budgets (`loop`'s max_rounds, max_samples) are the holders': they must agree;
        a joining worker started with others takes theirs (and says so)."""
        run = {}
        for name, row in (("max_rounds", _MAX_ROUNDS), ("max_samples", _MAX_SAMPLES)):
            values = {v for v, h in zip(table[row], table[_HOLDS]) if h}
            if len(values) > 1:
                raise ValueError(f"{_PREFIX}: round {decision['round']}: the workers passed different {name} to "
                                 f"loop(): {dict(zip(self._names(decision['members']).split(','), table[row]))} "
                                 "(0 = none); every worker must pass the same")
            run[name] = values.pop() if values else 0
        if {k: self._budgets.get(k, 0) for k in run} != run:
            self._log(f"the run's budgets are {run} (0 = none), not this worker's {self._budgets}: taking the run's")
            self._budgets = run

    def _apply(self, decision: dict) -> None:
        """The epoch committed: this worker holds the run's state at the decision's round."""
        self._load_global()
        self._holds = True
        self._round = decision["round"]

    # ---- parameters --------------------------------------------------------------------------

    def _count(self, kind: str, begin: float) -> None:
        end = time.perf_counter()
        self._totals[kind] += end - begin
        self._timeline.append((kind, begin, end))
