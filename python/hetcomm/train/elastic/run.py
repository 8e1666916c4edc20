"""DiLoCo with elastic membership: ``hetcomm.DiLoCo(..., membership=hetcomm.Elastic(store=...))``.

The run is a sequence of *generations*. A generation is one `DiLoCo` over a process group of the
members of the time: every feature of the fixed group (local-step policies, weighting,
compression, overlap with fragments, workers of several ranks) runs in it unchanged. Membership
changes only between generations, through the store protocol of `epochs` (an *epoch*:
arrive, decide, form the group, send the state to the members without it, commit), and so:

* **a join**: a worker that asks to join is seen by the members between steps (the store, every
  half second). A member that sees it ends its round at that step (once no synchronisation is in
  flight), and an agreement at that boundary, before the round is reduced, ends the generation on
  every rank (staggered fragments fired and waited for). The round is not reduced: each rank
  carries it into the next generation (below), which an epoch forms with the joiner, and the
  joiner contributes to that same round.
* **a leave**: a worker whose data ends says so the same way; its last round is synchronised,
  then it leaves, and the others form the next generation without it.
* **a failure**: a collective that fails (a dead peer, a broken link, ``collective_timeout``)
  ends the generation on the ranks that see it, at once; the others see it at their next
  collective. Nothing is rolled back: each rank's global state is what it applied. Ranks that
  applied an outer step the others did not (the peer died inside a reduction some ranks had
  finished) are ahead by at most one reduction; the epoch names the most advanced as the holders
  (`_latest_holders`, by the count of outer steps applied), and they send their state to the
  others. Every member then starts the next generation from the same global parameters, which
  the epoch checks (fingerprints), and carries on the round the failure interrupted.

**A round carried on** (`carry.take_round`, `carry.resume_round`): a rank keeps what its replica
moved since the round began and was never sent (``start − replica``), with the round's steps,
samples and staggered windows, and moves its replica onto the new generation's global
parameters by it; the ``time`` policy's deadline counts from when the round began. A rank drops
it when it was taken inside the round's synchronous reduction and a member finished that (the
state holds the round already); where none finished it but members applied some of its
fragments, it keeps the rest (`carry.held_out`). A worker's ranks keep theirs only all together. With
overlap, the reductions in flight that a failure leaves unapplied on every member go on with the
round (`carry.Lost`).

The step times the policies measured and the ``time`` policy's round length carry over to the
next generation (`carry.seed_policy`); the quantisation residuals (error feedback) do not. What a
generation starts from is agreed over its group, never unpickled and never taken from the store
alone (`hetcomm.train.elastic.carry`).
A worker of several ranks (``Elastic(worker=...)``, the same name on each of its ranks) clears
its inner optimizer's state at each new generation, so that its ranks start with identical
replicas whichever of them is new. Checkpoints: `hetcomm.train.elastic.checkpoint`.
"""
from __future__ import annotations

import concurrent.futures
import copy
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from hetcomm.train import flat as _flat
from hetcomm.train.diloco.agreement import NonFinite
from hetcomm.train.diloco.loop import DiLoCo
from hetcomm.train.diloco.outer import default_outer_optimizer
from hetcomm.train.diloco.pacing import check_pace
from hetcomm.train.diloco.shard import reachable_bytes
from hetcomm.train.elastic import checkpoint as _checkpoint, handover, sharded, watchdog
from hetcomm.train.elastic.carry import (Round, encode_name, job_bits, resume_round, seed_policy, share_timing,
                                         start_table, take_round)
from hetcomm.train.elastic.common import _MAX_ABORTS, _PREFIX, _read_ended
from hetcomm.train.elastic.loop import ElasticBase
from hetcomm.train.elastic.options import Elastic, check_options
from hetcomm.train.elastic.phases import Phases
from hetcomm.train.elastic.run_epochs import RunEpochs
from hetcomm.train.local_steps import TimeSteps, make_policy
from hetcomm.train.membership import StoreUnreachable


class _Generation(DiLoCo):
    """A generation's DiLoCo. Its replicas start equal (the epoch loaded the global parameters it
    checked into every model), so it does not broadcast them again."""
    _replicas_equal = True
    _reform_at_boundary = True
    _reform_agreed_at: float | None = None        # when its ranks agreed to end it (`Phases`)
    _state_job: concurrent.futures.Future | None = None    # the joiners' state, sent in the background

    def _background_jobs(self) -> list:
        return super()._background_jobs() + [self._state_job]

    def _synchronise(self) -> None:
        # The boundary's collectives on the background group (a synchronous reduction, the last
        # fragments, the final agreement) come after the joiners' state there (`handover`).
        if self._state_job is not None:
            begin = self._clock()
            concurrent.futures.wait([self._state_job])
            end = self._clock()
            self._totals["idle"] += end - begin
            self._timeline.append(("idle", begin, end))
            handover.check(self)
        super()._synchronise()

    def _agree_on_reform(self, last: bool) -> None:
        super()._agree_on_reform(last)
        if self._stopped and self._reform_agreed_at is None and str(self._stop_reason).startswith("membership"):
            self._reform_agreed_at = time.perf_counter()


class ElasticRun(RunEpochs, ElasticBase):
    """`DiLoCo` in generations over elastic membership (see the module doc). Construct it as
    ``hetcomm.DiLoCo(model, opt, membership=Elastic(...), **options)``: the options are
    DiLoCo's, the same on every worker (a joiner with others is refused)."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer | None = None, *,
                 membership: Elastic,
                 outer_optimizer: Callable[[Sequence[torch.Tensor]], torch.optim.Optimizer] | None = None,
                 local_steps: str = "fixed", steps: int = 50, round_seconds: float | None = None,
                 weighting: str = "batch", compress: str = "fp32", block: int = 2048,
                 error_feedback: bool = False, overlap: bool = False, overlap_steps: int | None = None,
                 fragments: int = 1, stagger: bool = True, pace: float | None = None,
                 early_weight: float | None = None, ema: float = 0.3, threshold: float = 0.01, inner_sync: bool = True,
                 worker_backend: str | None = None, **fixed_only) -> None:
        shard_state = check_options(membership, fixed_only, inner_sync, local_steps)
        make_policy(local_steps, steps, round_seconds=round_seconds, threshold=threshold)   # checks them now
        check_pace(pace, overlap, fragments, stagger)
        m = membership
        worker = m.worker
        # State sharded over each worker's ranks (`sharded`): this rank's share, (1, 0) the whole.
        self._sharded, self._share, self._model_global = bool(shard_state), (1, 0), False
        self._whole: list | None = None       # (the fragments its share is cut from: `sharded`)
        super().__init__(model, inner_optimizer, store=m.store, worker_id=m.worker_id, job=m.job,
                         outer_optimizer=outer_optimizer, weighting=weighting, compress=compress, block=block,
                         min_workers=m.min_workers, heartbeat=m.heartbeat, timeout=m.timeout,
                         late_timeout=m.late_timeout, collective_timeout=m.collective_timeout, backend=m.backend,
                         verbose=m.verbose)
        self._factory = outer_optimizer or default_outer_optimizer
        if self._sharded:
            sharded.check_factory(self._factory, self._params)
        self._options = dict(local_steps=local_steps, steps=steps, round_seconds=round_seconds, weighting=weighting,
                             compress=compress, block=block, error_feedback=error_feedback, overlap=overlap,
                             overlap_steps=overlap_steps, fragments=fragments, stagger=stagger, pace=pace,
                             early_weight=early_weight, ema=ema, threshold=threshold, inner_sync=inner_sync,
                             worker_backend=worker_backend)
        self._worker = worker or self.worker_id
        self._explicit = worker is not None       # a worker of several ranks is named explicitly
        try:
            encode_name(self._worker)
        except ValueError as e:
            raise ValueError(f"{_PREFIX}: {e}") from None
        self._carried = (0, 0, False)              # (round, outer steps, held the state) before the last epoch
        self._jobs_done: tuple[int, int, int] | None = None    # (generation, reductions, applied: `_carry_out`)
        self._inner: DiLoCo | None = None
        self._base = (0, 0, None)          # (round, applied, generation) at the inner DiLoCo's start
        self._applied_total = 0            # outer steps applied in the run (one per fragment)
        self._leaving = False
        self._waiting: set[str] = set()    # joiners seen since the last epoch
        self._failures = 0                 # generations in a row that ended in a failure
        self._generations: list[dict] = []
        self._workers_names: list[str] = []
        # worker name -> (seconds per step, windows, the steps' EMA): `StepTimes`, by name
        self._step_times: dict[str, tuple[float, int, float | None]] = {}
        self._policy_state: dict | None = None                 # the ``time`` policy's, last generation
        self._carry: Round | None = None   # the round a generation ended inside of, carried into the next
        self._formed: dict | None = None   # what forming the current generation cost (`Phases`)
        self._torn = False                 # closed while a synchronisation still ran (`close`)

    # ---- the training loop's side ------------------------------------------------------------

    def join(self) -> None:
        """Waits until an epoch admits this worker, then starts the generation's DiLoCo."""
        if self._joined:
            return
        super().join()
        try:
            self._generation()
        except BaseException:
            self.close()
            raise

    def step(self, samples: int | None = None, loss: float | None = None) -> bool:
        """Call after every inner step; returns True when it synchronised (or the generation
        ended and the next one started)."""
        if not self._joined or self._closed or self._stopped:
            raise RuntimeError(f"{_PREFIX}: step() " + ("before join() (or use loop())" if not self._joined
                                                        else f"after the run stopped ({self._stop_reason})"
                                                        if self._stopped else "after close()"))
        self._step_calls += 1
        try:
            self._pulse.check()
            self._scan()
            inner, ended = self._inner, False
            try:
                if inner._hook_error is not None:      # the worker's gradient averaging failed
                    raise inner._hook_error
                handover.check(inner)                  # (a holder: the joiners' state failed to go)
                synced = inner.step(samples, loss)
                if inner.should_stop:                  # every rank stopped at this boundary
                    if inner._carry_round:             # (a join: the round goes on in the next generation)
                        self._carry = take_round(inner, self._base[1], cut=True)
                    inner.finish()
                    self._model_global = True          # (finish left the global parameters in the model)
                    ended = True
            except StoreUnreachable:
                raise
            except (RuntimeError, NonFinite) as e:     # a collective failed: the generation is over
                self._recover(e)
                return True
            if ended:
                self._inner = None
                self._after_generation(inner)
                return True
        except BaseException:
            self.close()
            raise
        return synced

    def _agreed(self, batches):
        """`loop`'s batches, while every rank of this worker has one (they step together)."""
        if self._inner is not None:
            self._inner._budgets = self._inner_budgets()     # (join() may have come before loop())
        for item in batches:
            if not self._worker_has(True):
                return
            yield item
        self._worker_has(False)

    def _worker_has(self, have: bool) -> bool:
        inner = self._inner
        if inner is None or inner._workers.size == 1:
            return have
        try:
            return inner._workers.all_have(have)
        except StoreUnreachable:
            raise
        except RuntimeError as e:          # a rank of the worker is gone: the generation is over
            self._recover(e)
            return have

    def _finish(self, why: str, synchronise: bool = True) -> None:
        if self._closed:
            return
        try:
            if synchronise and self._joined and not self._stopped and self._inner is not None \
                    and self._inner._hook_error is None:
                # Its last round is synchronised with the others, whose generation ends with it.
                self._leaving = True
                inner = self._inner
                try:
                    inner.finish()
                    self._inner = None
                    self._model_global = True
                    self._carry_out(inner)
                except (RuntimeError, NonFinite) as e:
                    self._log(f"leaving without synchronising its last round (the synchronisation failed: "
                              f"{str(e).splitlines()[0][:200]})")
            if self._keys is not None:
                self._keys.set(f"leave/{self._me}", {"round": self.rounds, "why": why})
        finally:
            self.close()

    def close(self) -> None:
        """Releases the generation's DiLoCo, the group and the heartbeat, without communicating
        (what the generation applied stays readable: `rounds`, `history`, `global_parameters`;
        but with a synchronisation still running, the global parameters are the generation's,
        which it may still update, and `state_dict` refuses)."""
        watchdog.disarm(self)
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()                  # (cancels the queued jobs: only a running one is busy)
            busy = self._busy(inner)
            if not busy:
                try:
                    self._carry_out(inner)
                except Exception:  # noqa: BLE001 - on the way out of an error: best effort
                    self._torn = True
            else:                          # (it may still write the global parameters: `state_dict` refuses)
                self._torn = True
        super().close()

    @staticmethod
    def _busy(inner: DiLoCo) -> list:
        """The background synchronisations of ``inner`` still running."""
        return [f for f in inner._background_jobs() if f is not None and not f.done()]

    # ---- results -----------------------------------------------------------------------------

    @property
    def rounds(self) -> int:
        """Rounds of the run whose outer update this worker has applied (counted across
        generations, restarts and joins)."""
        return self._round + (len(self._inner.history) if self._inner is not None else 0)

    @property
    def history(self) -> list[dict]:
        """One record per round: DiLoCo's record (`DiLoCo.history`, its lists one entry per worker
        of the generation) with the run's round number, the ``generation``, its ``workers`` (names)
        and ``fingerprint``, a hash of the global parameters after the round's update."""
        live = [] if self._inner is None else [self._renumber(r) for r in self._inner.history]
        return list(self._history) + live

    def stats(self) -> dict:
        """The run's rounds, samples, current members and membership changes, and per generation
        this worker took part in, its DiLoCo's `stats` (the current one's last)."""
        out = super().stats()
        out["rounds"] = self.rounds
        live = self._inner.history if self._inner is not None else []
        out["samples_total"] = self._samples_total + sum(sum(r["samples"]) for r in live)
        out["generations"] = list(self._generations) + ([{"generation": self._base[2], "formed": self._formed,
                                                          **self._inner.stats()}]
                                                         if self._inner is not None else [])
        return out

    def fingerprint(self) -> int:
        """A hash of the global parameters (equal on every member between rounds; with sharded
        state, `flat.additive_print`'s, as in the rounds' records, and after the run only)."""
        if self._sharded:
            return sharded.fingerprint(self.global_parameters())
        source = self._inner._global if self._inner is not None else self._global
        return _flat.fingerprint(_flat.flatten(source))

    def global_parameters(self) -> list[torch.Tensor]:
        if self._sharded and (self._inner is not None or self._share != (1, 0)):
            return sharded.global_parameters(self)
        source = self._inner._global if self._inner is not None else self._global
        return [g.detach() for g in source]

    def gather_global_parameters(self) -> list[torch.Tensor]:
        """The whole global parameters: with sharded state, while a generation runs, a collective
        over this worker's ranks (`DiLoCo.gather_global_parameters`: call it on every rank of the
        worker at the same point, when `step` returned True at a round boundary); otherwise
        `global_parameters`."""
        if self._sharded and self._inner is not None:
            return self._inner.gather_global_parameters()
        return self.global_parameters()

    def state_bytes(self) -> int:
        """Bytes of the tensors this rank keeps for the run (`DiLoCo.state_bytes`): the
        generation's DiLoCo and what the run holds besides (a round carried between generations)."""
        return reachable_bytes(self, self.model, self.inner_optimizer)

    def state_dict(self) -> dict:
        """The rounds this worker has applied (`hetcomm.train.elastic.checkpoint.save`): the round in
        progress is not in it; with overlap it waits for the synchronisation in flight."""
        return _checkpoint.save(self)

    def load_state_dict(self, state: dict) -> None:
        """Resumes from `state_dict` before `join` (`hetcomm.train.elastic.checkpoint.load`)."""
        _checkpoint.load(self, state)

    # ---- generations -------------------------------------------------------------------------

    def _generation(self) -> None:
        """Starts the generation's DiLoCo over the group the last epoch formed (another epoch
        when that fails)."""
        while True:
            watchdog.arm(self)                     # (the epoch's group: a member silent from now on ends it)
            if self._state_deferred is not None:
                # A joiner's samples are not the run's until its state lands: the members agree
                # (`handover.agree_on_stop`), and if the run ends here the joiners get the state now.
                try:
                    handover.agree_on_stop(self)
                    self._phases.mark("stop agreement")
                except (StoreUnreachable, ValueError, TypeError):
                    raise
                except RuntimeError as e:          # (a member gone since the epoch committed)
                    watchdog.disarm(self)
                    self._abort(watchdog.explain(self, e, self._gen), "while starting the generation")
                    continue
                if self._stopped:
                    handover.send_now(self)
                    watchdog.disarm(self)
                    return
            elif not self._stopped:
                # Every member (a joiner too: it has the run's round and budgets) decides alike;
                # a run another member ended (its budget, at a round this one did not finish) too.
                self._check_budgets()
                ended = None if self._stopped else _read_ended(self._keys)
                if ended is not None:
                    self._stopped = True
                    self._stop_reason = f"the run ended at round {ended['round']}"
            if self._stopped:
                watchdog.disarm(self)
                return
            try:
                self._inner = self._build()
                watchdog.arm(self)                 # (again: the groups of its DiLoCo too)
                self._phases.mark("start")
                self._formed = self._phases.end()
                if self._formed is not None:
                    self._log(f"generation {self._gen} started {Phases.describe(self._formed)}")
                return
            except (StoreUnreachable, ValueError, TypeError):
                raise
            except RuntimeError as e:
                watchdog.disarm(self)
                self._abort(watchdog.explain(self, e, self._gen), "while starting the generation")

    def _build(self) -> DiLoCo:
        # Agreed over the group, not taken from the store: the count of outer steps applied (the
        # holders', the largest; the transfer does not carry it), the samples, the workers.
        # (a holder that holds another round, or nothing outside an era of fresh models)
        named = self._me in self._decision["holders"]
        disowned = named and (self._carried[0] != self._decision["round"] if self._carried[2]
                              else not self._decision.get("fresh"))
        start = start_table(self._worker, self._explicit, *self._carried[:2], self._samples_total, disowned=disowned,
                            carried=self._carry and self._carry.summary(self._jobs_done and self._jobs_done[1]),
                            jobs=self._jobs_done)
        self._phases.mark("start table")          # (the first exchange: waits for the slowest member)
        if start["disowned"]:
            raise ValueError(f"{_PREFIX}: the decision of epoch {self._decision['epoch']} (on the store) names round "
                             f"{self._decision['round']}, but rank(s) {start['disowned']} it names as holders of the "
                             "run's state hold another round, or none: the store's records were altered (or a bug)")
        self._applied_total, self._samples_total = max(start["applied"]), max(start["samples"])
        names = start["names"]
        labels = [names.index(n) for n in names]
        shared = [r for r, label in enumerate(labels) if labels.count(label) > 1 and not start["explicit"][r]]
        if shared:
            raise ValueError(f"{_PREFIX}: ranks {shared} share the worker name(s) {sorted({names[r] for r in shared})} "
                             "without naming a worker of several ranks: give each process its own worker_id, or "
                             "the ranks of one worker the same Elastic(worker=...)")
        self._workers_names = list(dict.fromkeys(names))
        # What the policies measured, by worker name: rank 0's (a member of the last generation
        # unless the era is new), so that every rank plans the first round alike. The workers not
        # in this generation keep theirs (unused in it): one who comes back (a restart) is planned
        # from them, where the rounds would otherwise keep their old plan until it had been
        # measured twice again (`TimeSteps.agreed`).
        shared, self._policy_state = share_timing(self._step_times, self._policy_state, self._workers_names)
        self._step_times = {**{k: v for k, v in self._step_times.items() if k not in self._workers_names}, **shared}
        if labels.count(labels[dist.get_rank()]) > 1 and self.inner_optimizer is not None:
            self.inner_optimizer.state.clear()     # a worker's ranks start from identical replicas
        self._model_global = False
        inner = _Generation(self.model, self.inner_optimizer, outer_optimizer=self._factory, workers=labels,
                            shard_state=None if self._sharded else False, state_device="cpu", **self._options)
        self._phases.mark("diloco")                # (its state, its groups: with overlap, one more)
        try:
            shares = None
            if self._sharded:                      # (the shares move from the holders: `sharded`)
                shares = sharded.load(self, inner, self._decision)
                self._phases.mark("state")
            else:
                with torch.no_grad():
                    for mine, g in zip(inner._global, self._global):
                        mine.copy_(g)
                    inner._start.copy_(inner._flatten_global())
                inner.outer_optimizer.load_state_dict(copy.deepcopy(self.outer_optimizer.state_dict()))
            seed_policy(inner, self._workers_names, self._step_times, self._policy_state)
            kept = resume_round(inner, self._carry, start, labels, sharded=shares)
        except BaseException:
            inner.close()
            raise
        if self._carry is not None:
            self._log(f"round {self._round + 1} goes on in generation {self._gen}: {self._carry.describe(kept)}")
        self._carry = None
        inner._reform = self._wants_reform
        inner._defer_hook_errors = True
        inner._print_rounds = "additive" if self._sharded else True
        self._base = (self._round, self._applied_total, self._gen)
        inner._budgets = self._inner_budgets()
        try:
            handover.start(self, inner)            # (a transfer the epoch left to the generation)
        except BaseException:
            inner.close()
            raise
        # While the generation runs, the run's state is its DiLoCo's: one copy on this rank, not
        # two (`_carry_out` keeps it when the generation ends).
        self._global, self.outer_optimizer = inner._global, inner.outer_optimizer
        self._share, self._whole = sharded.share_of(inner), sharded.whole_fragments(inner)
        self._holds = True                 # (with sharded state, a member without it until now: once it is in)
        return inner

    def _inner_budgets(self) -> dict[str, float]:
        """The run's budgets (`loop`) as what is left of them for the generation (the same on every
        rank: the round and samples were agreed in `_build`)."""
        limit_r, limit_s = self._budgets.get("max_rounds", 0), self._budgets.get("max_samples", 0)
        return {"max_rounds": float(max(1, limit_r - self._base[0])) if limit_r else 0.0,
                "max_samples": float(max(1, limit_s - self._samples_total)) if limit_s else 0.0,
                "max_seconds": 0.0}

    def _renumber(self, record: dict) -> dict:
        base_round, _, gen = self._base
        return {**record, "round": base_round + record["round"], "generation": gen,
                "workers": list(self._workers_names)}

    def _carry_out(self, inner: DiLoCo) -> None:
        """What the ended generation applied becomes the run's state (the rounds it recorded,
        the global parameters, the outer optimizer's state)."""
        records = [self._renumber(r) for r in inner._history]     # every one applied (and recorded)
        if self._global is not inner._global:      # (else the run's state is the generation's: `_build`)
            with torch.no_grad():
                for g, mine in zip(self._global, inner._global):
                    g.copy_(mine)
            self.outer_optimizer.load_state_dict(copy.deepcopy(inner.outer_optimizer.state_dict()))
        self._history.extend(records)
        self._round = self._base[0] + len(records)
        self._samples_total += sum(sum(r["samples"]) for r in records)
        self._applied_total = self._base[1] + inner._applied
        self._jobs_done = (self._base[2], inner._jobs, job_bits(inner._applied_jobs, inner._jobs))  # `carry.added`
        times = inner._times
        for label, name in enumerate(self._workers_names):
            if times._t[label] is not None:
                self._step_times[name] = (times._t[label], times._windows[label], times._n[label])
        if isinstance(inner._policy, TimeSteps):
            self._policy_state = inner._policy.state_dict()
        try:
            self._generations.append({"generation": self._base[2], "formed": self._formed, **inner.stats()})
        except Exception as e:  # noqa: BLE001 - the stats of a failed generation are best effort
            self._generations.append({"generation": self._base[2], "formed": self._formed,
                                      "error": f"{type(e).__name__}: {e}"})

    def _after_generation(self, inner: DiLoCo) -> None:
        """Every rank finished the generation at the same boundary: the run ends (a budget) or
        the next generation forms (a worker joins or leaves)."""
        watchdog.disarm(self)
        self._carry_out(inner)
        if inner._history:
            self._failures = 0             # (a cut that reduced nothing is no progress)
        reason = inner.stop_reason or ""
        if reason.startswith("membership"):
            self._phases.begin("agreement to change members", at=inner._reform_agreed_at)
            self._phases.mark("syncs in flight")
            self._reform()
            self._generation()
            return
        self._check_budgets()
        if not self._stopped:
            self._stopped, self._stop_reason = True, reason
            self._keys.first("ended", {"round": self._round, "reason": reason})

    def _recover(self, error: BaseException) -> None:
        self._phases.begin("failure")
        inner, self._inner = self._inner, None
        every = [f for f in inner._background_jobs() if f is not None]
        inner.close()
        # The background thread may still be inside a collective of the failed group: wait for it
        # (it fails within the collective timeout) before reading what it applied. Not for the
        # jobs `close` cancelled: `wait` never counts those as done (they are never "notified").
        futures = self._busy(inner)
        concurrent.futures.wait(futures, timeout=self._collective_timeout + 10.0)
        # Then DiLoCo's own groups go: a peer waiting in one of their collectives that this
        # rank will never join (a job it cancelled) fails now, not at its collective timeout.
        inner._release_groups()
        watchdog.disarm(self)              # (armed through the wait: a job stuck on a silent member ends)
        error = watchdog.explain(self, error, self._base[2])
        if any(not f.done() for f in futures):
            self._torn = True              # (it may still write the run's state: the generation's)
            raise RuntimeError(f"{_PREFIX}: the background synchronisation did not end within "
                               f"{self._collective_timeout + 10:.0f} s of a failure; the run cannot go on") from error
        self._phases.mark("syncs in flight")
        # A pseudo-gradient that was not finite (raised alike on every rank, here or in a job: a
        # rank may first see the group fail after another left over it) leaves its worker out.
        found = error if isinstance(error, NonFinite) else next(
            (f.exception() for f in every if f.done() and not f.cancelled() and isinstance(f.exception(), NonFinite)),
            None)
        if found is not None:
            try:
                error = self._left_out(inner, found)
            except BaseException:          # (this worker stops: its counts must follow its state)
                self._carry_out(inner)
                raise
        if self._carry is None:            # (else taken at the cut boundary; finish() failed after it)
            # (a round a join cut stays protected from another cut through a failure)
            self._carry = take_round(inner, self._base[1], cut=inner._carrying_in())
        if inner._applied:
            self._failures = 0             # the generation moved the run on: not a failure in a row
        self._carry_out(inner)
        self._abort(error, f"in round {self._round + 1}")
        self._generation()

    def _left_out(self, inner: DiLoCo, error: NonFinite) -> RuntimeError:
        """Workers whose pseudo-gradient is not finite stop (a ValueError on their ranks; they
        leave); the others go on without them, carrying the round on (no update was applied
        with it): what they record as the generation's end."""
        labels = inner._labels
        bad = sorted({labels[r] for r in error.ranks if 0 <= r < len(labels)})
        if labels[inner._rank] in bad:
            why = "its pseudo-gradient is not finite (NaN or Inf in its parameters)"
            try:
                self._keys.set(f"leave/{self._me}", {"round": self.rounds, "why": why})
            except StoreUnreachable:
                pass                               # (its heartbeat ends with it: dropped all the same)
            raise ValueError(f"{_PREFIX}: round {self.rounds + 1}: this worker stops: {why}; no outer update was "
                             "applied and the others go on without it") from error
        names = ", ".join(self._workers_names[label] for label in bad)
        return RuntimeError(f"{names} left out: the pseudo-gradient is not finite")

    def _abort(self, error: BaseException, where: str) -> None:
        """The generation failed: a new epoch, with whoever is still there."""
        why = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        self._failures += 1
        self._event({"round": self._round, "generation": self._gen, "aborted": why},
                    f"the generation failed {where} ({why}); the next forms from round {self._round}")
        self._destroy_group()
        if self._failures >= _MAX_ABORTS:
            raise RuntimeError(f"{_PREFIX}: {self._failures} generations in a row failed before a round ended; the "
                               f"last: {why}") from error
        self._outcome = "abort"            # the next decision forms a new group, even with the same members
        self._reform()

    def _reform(self) -> None:
        """An epoch: who is in the next generation, its group, and the state for those without it."""
        self._waiting.clear()
        self._carried = (self._round, self._applied_total, self._holds)
        if not self._synchronise():
            self._event({"round": self._round, "worker": self.worker_id, "dropped": self._dropped_why},
                        f"round {self._round}: this worker was dropped ({self._dropped_why}); it joins again")
            self._holds = False
            self._carry = None             # (it joins again: from the run's state)
            self._jobs_done = None
            self._destroy_group()
            self._new_incarnation()
            self._admit()
        if not self._stopped:
            self._check_budgets()

