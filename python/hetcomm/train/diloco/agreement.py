"""The agreement at a round's boundary: the exchange of the table (`table`), its checks, the
reduction of the boundary's fragments with their outer steps, and what the ranks decide from it
(the policy's measurements, the stop, the history), and this rank's column of the table and
pseudo-gradient. `Agreement` is a part of `DiLoCo`."""
from __future__ import annotations

import math

import torch

from hetcomm.train import flat as _flat
from hetcomm.train.diloco import handoff
from hetcomm.train.diloco.outer import outer_weights
from hetcomm.train.diloco.table import (_AGGREGATE, _BUDGETS, _COMPUTE, _DONE, _ELAPSED, _FINITE, _FRAGMENTS,
                                        _LANDED, _LOSS_N, _LOSS_SUM, _REFORM, _REPLICA, _ROWS, _SAMPLES, _STEPS,
                                        _SYNC_WALL, _TOT_BYTES, _TOT_IDLE, _TOT_SYNC, _TOT_WAN, _known, history_record,
                                        stop_decision)
from hetcomm.train.partition import exchange_columns

_PREFIX = "hetcomm DiLoCo"


class NonFinite(ValueError):
    """A pseudo-gradient that is not finite (NaN or Inf): no outer update was applied. Raised
    alike on every rank; ``ranks`` are those whose pseudo-gradient it was."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class Agreement:
    """The round boundary's agreement and reduction (on the background thread with overlap)."""

    _reform_at_boundary = False      # a generation of an elastic run (see `_agree_on_reform`)
    _carry_round = False             # ... that ended without reducing its round (a join)
    _resumed = False                 # ... whose first round a join cut in the last (`carry.resume_round`)
    _sending: int | None = None      # outer steps applied when this rank began to send its round
    _sent: dict[int, int] | None = None     # ... and the outer steps before each fragment's part left
    _sending_from = 0                # ... and the rounds recorded then

    def _send(self, f: int) -> None:
        """Fragment f's part of the round is about to leave in a reduction: inside this rank's
        synchronous boundary (`_sending`), the outer steps applied before it, the first time (a
        fragment reduced twice there sends this rank's steps in the first: the second window is
        empty). A member that applied more holds that part (`elastic.carry.held_out`)."""
        if self._sending is not None and self._sent is not None:
            self._sent.setdefault(f, self._applied)

    def _agree_on_schedule(self, stagger, group) -> None:
        """At construction: the schedules of the collectives must line up from the first round on
        (the fragments, staggered or not; sharded state or not; the shares' sizes)."""
        if not isinstance(stagger, bool):
            raise TypeError(f"{_PREFIX}: stagger must be True or False, got {stagger!r}")
        shape = float(len(self._fragments) * (-1 if stagger and len(self._fragments) > 1 else 1))
        index = -1.0 if self._layout is None or self._layout.index is None else float(self._layout.index)
        shapes, sharded, indices, sizes = exchange_columns(
            [shape, float(self._layout is not None), index, float(self._start.numel())], group=group)
        if len(set(shapes)) > 1:
            raise ValueError(f"{_PREFIX}: the ranks reduce in different numbers of fragments: "
                             f"{dict(enumerate(int(x) for x in shapes))} (negative: staggered); construct DiLoCo with "
                             "the same fragments, stagger (and model) everywhere")
        if len(set(sharded)) > 1:
            raise ValueError(f"{_PREFIX}: some ranks shard DiLoCo's state over their worker and some do not: "
                             f"{dict(enumerate(bool(x) for x in sharded))}; construct DiLoCo with the same "
                             "shard_state, outer optimizer and model everywhere")
        odd = sorted({int(k) for k, n in zip(indices, sizes) if k >= 0 and n != sizes[indices.index(k)]})
        if odd:
            raise ValueError(f"{_PREFIX}: the ranks holding share(s) {odd} of the state hold different numbers of "
                             f"elements ({dict(enumerate(int(n) for n in sizes))}): the workers' models (or their "
                             "FSDP2 sharding) differ")

    def _agree_on_reform(self, last: bool) -> None:
        """A generation of an elastic run (`hetcomm.train.elastic.run`): whether a rank asks to end
        it, agreed at this boundary before the round is reduced, over the training thread's group
        (one small collective; the background thread has a group of its own). ``_reform()`` says
        2 when a worker leaves (its last round is reduced with the others'), 1 when workers wait to
        join: then the round is not reduced (unless it is the run's last): every rank carries it
        on into the next generation, where the joiners contribute to it (`_carry_on`). With
        staggered fragments and ``overlap_steps``, the fragments not fired this round are fired
        before it (`_synchronise`): a rank that waits for a fragment's job τ steps after firing it
        then finds it queued everywhere (without τ nobody waits for a job inside a round)."""
        if not self._reform_at_boundary or self._stopped:
            return
        code = max(exchange_columns([float(self._reform())], group=self._group)[0])
        if code > 0:
            self._stopped, self._stop_reason = True, "membership: a worker asks to join or leave"
            # A join cuts a round once: one a join cut is reduced first (joins that never come,
            # or a store writer's, must not keep the run from any outer step).
            self._carry_round = code == 1 and not last and not self._carrying_in()

    def _carrying_in(self) -> bool:
        return self._resumed and not self._history

    def _cut_for_joiners(self) -> bool:
        """A generation of an elastic run ends its round at this step when workers wait to join,
        no synchronisation is in flight, and the round is to be carried on (`_carry_on`): not the
        run's last, not one carried in already."""
        # (the synchronisation in flight first: it appends to the history when it lands)
        if not self._reform_at_boundary or not (self._pending is None or self._pending.done()) \
                or self._carrying_in():
            return False
        limit = self._budgets["max_rounds"]
        if limit and len(self._history) + 1 >= limit:
            return False
        return self._reform() == 1

    def _carry_on(self) -> None:
        """The round is not reduced: it goes on in the next generation. Every fragment that some
        rank fired this round is fired on every rank (their jobs line up), and every job is
        waited for, so that the global parameters are final and what each rank carries
        (``start − replica``, `hetcomm.train.elastic.run`) is only what it did not send."""
        if self._stagger:
            self._fire_rest()
            self._join_streams(agree=self._workers.size > 1)

    def _exchange_and_reduce(self, column: list[float], delta: torch.Tensor, *, timed: bool,
                             plan: dict, order: int | None = None) -> tuple[list[list[float]], list[float]]:
        """The boundary's agreement on the round's table and reduction of its fragments (in the
        background with overlap: ``order``, its number, `_jobs`)."""
        group = self._sync_group
        start = self._clock()
        ranks = exchange_columns(column, group=group)
        agreed = self._clock()
        if timed:
            self._totals["idle"] += agreed - start
            self._timeline.append(("idle", start, agreed))
        round_index = len(self._history) + 1
        bad = [r for r in range(self._world) if ranks[_FINITE][r] == 0.0]
        if bad:
            raise NonFinite(f"{_PREFIX}: round {round_index}: the pseudo-gradient of rank(s) {bad} is not finite "
                            "(NaN or Inf in their parameters); no outer update was applied", bad)
        for name, row in _BUDGETS.items():
            if len(set(ranks[row])) > 1:
                raise ValueError(f"{_PREFIX}: the ranks passed different {name} to loop(): "
                                 f"{dict(enumerate(ranks[row]))} (0 = none); every rank must pass the same")
        if len(set(ranks[_FRAGMENTS])) > 1:             # the reduction would not line up
            raise ValueError(f"{_PREFIX}: the ranks reduce in different numbers of fragments: "
                             f"{dict(enumerate(int(x) for x in ranks[_FRAGMENTS]))} (negative: staggered); construct "
                             "DiLoCo with the same fragments, stagger (and model) everywhere")
        split = self._workers.diverged(ranks[_REPLICA], list(zip(ranks[_STEPS], ranks[_LANDED])))
        if split:
            raise ValueError(f"{_PREFIX}: round {round_index}: the ranks of worker(s) {split} hold different replicas "
                             "(different steps, pseudo-gradients or steps at which the late update landed): a "
                             "worker's ranks must step together on the same replica (inner_sync=True, or DDP over "
                             "diloco.worker_group)")
        table = self._workers.aggregate(ranks, _AGGREGATE)
        if not timed:
            self._pending_agreed = (round_index, table)     # for `_shorten_last_round`, at once
        any_steps = any(s > 0 for s in table[_STEPS])
        weights = outer_weights(self.weighting, table[_SAMPLES], table[_STEPS])
        if any_steps and any(w != 0.0 for w in weights):
            for f, (i, j, a, b) in enumerate(self._boundary):
                self._send(f)
                part = self._reduce_agreed(delta[a:b], weights,
                                           self._feedback[f] if self._feedback is not None else None,
                                           background=not timed, fragment=f)
                # The outer step of this fragment's parameters alone (the others have no gradient).
                for g, piece in zip(self._global[i:j], _flat.split(part, self._global[i:j])):
                    g.grad = piece.view(g.shape).to(g.device, g.dtype)
                self.outer_optimizer.step()
                self.outer_optimizer.zero_grad(set_to_none=True)
                self._applied += 1
                if order is not None:          # (a part applied: a rank that lost it drops it whole)
                    self._applied_jobs.add(order)
                handoff.settle(self._device)   # (its outer step ran: the move reads it at once)
                self._landed = f + 1           # the training thread may move onto these now
        self._landed = len(self._boundary)
        end = self._clock()
        self._timeline.append(("sync", agreed, end))
        if timed:
            self._totals["sync"] += end - agreed
        else:
            # From the agreement (not from this rank's boundary: waiting there for the last rank
            # would feed the skew between the ranks back into the round length). Not the first
            # one's: it pays for the group's first collectives and fresh connections (2.1 s
            # against 1.1 s at 20 Mbit/s, int4), and a round planned from it would be twice as
            # long as the link needs; unknown (0), the round lasts until the one in flight lands.
            self._background_syncs += 1
            # With staggered fragments, the link's time per round is theirs too.
            busy, self._stream_busy = self._stream_busy, 0.0
            busy -= self._pacer.take_delay() if self._pacer is not None else 0.0     # (`pacing`)
            self._sync_wall = end - agreed + busy if self._background_syncs > 1 else 0.0
        if any_steps:
            self._record(table, weights, round_index, plan, background=not timed)
        return table, weights

    def _after_agreement(self, table: list[list[float]], ahead: bool = False) -> None:
        self._times.update(table[_COMPUTE], table[_STEPS])
        self._times.retire([d > 0 for d in table[_DONE]])
        if self.overlap:
            self._policy.sync_took(max(table[_SYNC_WALL]))
        self._policy.agreed(self._times)
        if self.overlap:
            self._warn_if_link_bound()
        self._agreed_totals = {
            "compute": [0.0] * self._nworkers, "idle": table[_TOT_IDLE], "sync": table[_TOT_SYNC],
            "bytes": _known(table[_TOT_BYTES]), "wan": _known(table[_TOT_WAN]),
            "samples": [0.0] * self._nworkers, "steps": [0.0] * self._nworkers,
        }
        self._settled = len(self._history)
        for rec in self._history:
            for key, row in (("compute", "compute_seconds"), ("samples", "samples"), ("steps", "steps")):
                self._agreed_totals[key] = [a + b for a, b in zip(self._agreed_totals[key], rec[row])]
        if not self._stopped:
            self._stop_reason = self._stop_decision(table, ahead)
            self._stopped = self._stop_reason is not None
        self._last_elapsed = max(table[_ELAPSED])

    def _stop_decision(self, table: list[list[float]], ahead: bool, *, settled: int | None = None,
                       samples: float | None = None) -> str | None:
        """Why every rank stops after this agreement (`table.stop_decision`), by default with the
        rounds and samples agreed so far."""
        return stop_decision(table, ahead=ahead, rounds=self._settled if settled is None else settled,
                             samples=sum(self._agreed_totals["samples"]) if samples is None else samples,
                             last_elapsed=self._last_elapsed)

    def _record(self, table: list[list[float]], weights: list[float], round_index: int, plan: dict, *,
                background: bool) -> None:
        record = history_record(table, weights, round_index, plan)
        if self._print_rounds == "additive":        # (an elastic run's state sharded over its workers' ranks)
            try:
                record["fingerprint"] = self._global_print(background)
            except BaseException:
                # The outer step is applied: the round stays recorded (the elastic run counts its
                # rounds so), its hash filled in when the next generation starts (`sharded.load`).
                record["fingerprint"] = None
                self._history.append(record)
                raise
        elif self._print_rounds:
            record["fingerprint"] = _flat.fingerprint(_flat.flatten(self._global))
        self._history.append(record)

    def _column(self, delta: torch.Tensor) -> list[float]:
        # One pass: the float64 sum of a float32 vector is finite iff every element is (it cannot
        # overflow; an Inf or NaN anywhere makes it Inf or NaN). It is also the replica's fingerprint.
        total = float(torch.sum(delta, dtype=torch.float64)) if delta.numel() else 0.0
        finite = 1.0 if math.isfinite(total) else 0.0
        col = [0.0] * _ROWS
        col[_STEPS], col[_SAMPLES], col[_COMPUTE] = self._r_steps, self._r_samples, self._r_compute
        col[_LOSS_SUM], col[_LOSS_N], col[_FINITE] = self._r_loss, self._r_loss_n, finite
        col[_TOT_IDLE], col[_TOT_SYNC] = self._totals["idle"], self._totals["sync"]
        col[_TOT_BYTES] = self._bytes_sent() - self._bytes0
        col[_TOT_WAN] = self._workers.inter_worker_bytes(self._outer_groups()) - self._wan0
        col[_REPLICA] = total if self._layout is None else self._replica_print()
        col[_LANDED] = self._landed_steps()
        col[_SYNC_WALL] = self._sync_wall
        col[_FRAGMENTS] = len(self._fragments) * (-1 if self._stagger else 1)
        col[_DONE] = 1.0 if self._exhausted else 0.0
        col[_REFORM] = float(self._reform())
        col[_ELAPSED] = self._clock() - self._t0
        for name, row in _BUDGETS.items():
            col[row] = self._budgets[name]
        return col

    @torch.no_grad()
    def _progress(self) -> torch.Tensor:
        """start − replica (Δ_r, master precision), in the next pseudo-gradient buffer."""
        out = self._deltas[self._next_delta]
        self._next_delta = (self._next_delta + 1) % len(self._deltas)
        for p, s, o in zip(self._params, self._split(self._start), self._split(out)):
            src = p.detach().reshape(-1)
            if src.device != o.device or src.dtype != o.dtype:
                o.copy_(src)                        # to the state's device and precision, no new tensor
                src = o
            torch.sub(s, src, out=o)
        return out

    @torch.no_grad()
    def _global_into(self, out: torch.Tensor) -> None:
        for g, o in zip(self._global, self._split(out)):
            o.copy_(g.detach().reshape(-1))
