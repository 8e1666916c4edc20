"""A generation's members watched while it runs (`ElasticRun`): a member silent for ``timeout``
seconds (`Elastic(timeout=)`) ends the generation at once, as an epoch would drop it, instead of
holding the others in a collective until ``collective_timeout``.

A process that dies closes its connections and fails the collectives at once (the alarm leaves
it to them). One that is frozen (SIGSTOP, a debugger, a swapped-out machine), a machine that
vanishes or a link cut without a reset keep them open, and a collective with it waits for
``collective_timeout`` (60 s by default). While a generation runs, the heartbeat's store thread
(`hetcomm.train.pulse.Pulse.alarm`) watches its members. A member is *silent* when its counter
on the store has not moved for longer than ``timeout`` (counted to this worker's last read of
the store, so that its own stall is not taken for the others' silence) and, where its liveness
connection is verified, that connection has answered no ping for as long: the watcher pings it
every heartbeat and the member's link thread answers (sealed with an out-of-band secret),
so a store writer who holds a member's counter back cannot end a generation while the member
answers. Without a connection (no address published, a port that refuses) the counter decides
alone. Then the generation's process groups are aborted on this rank: the collectives in
progress and the next ones raise, the generation fails over, and the epoch that follows leaves
the silent member out (it rejoins when it comes back). A read of the store that took longer than
a heartbeat rings no alarm (a stalled store would make everyone look silent).

Only the hetcomm backend can abort a group in progress; with gloo (as the generation's backend or
as a worker's ``worker_backend``) the collective still waits for ``collective_timeout``.
"""
from __future__ import annotations

import torch.distributed as dist

from hetcomm.train.elastic.common import _PREFIX


def arm(run) -> None:
    """Watches the members of ``run``'s generation (every process group of this process now is
    the generation's: only those are aborted). Nothing to watch before a decision, or once the
    run has stopped."""
    if run._decision is None or run._stopped or run._gen is None:
        disarm(run)
        return
    groups = list(dist.distributed_c10d._world.pg_map)
    generation = run._gen
    if getattr(run, "_alarmed", None) is not None and run._alarmed[0] != generation:
        run._alarmed = None

    def fire(name: str, silent: float) -> None:
        if run._armed != generation or run._stopped:
            return                          # (disarmed as it rang: the generation is over)
        run._alarmed = (generation, name, silent)
        for pg in groups:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - a backend that cannot abort, or a group gone already
                pass

    run._armed = generation
    run._pulse.alarm([m for m in run._decision["members"] if m != run._me], run._timeout, fire)


def disarm(run) -> None:
    run._armed = None
    pulse = getattr(run, "_pulse", None)
    if pulse is not None:
        pulse.alarm(None, 0.0, None)


def explain(run, error: BaseException, generation) -> BaseException:
    """The failure of ``generation`` as the alarm saw it, when the alarm aborted it."""
    alarmed = getattr(run, "_alarmed", None)
    if alarmed is None or alarmed[0] != generation or not isinstance(error, RuntimeError):
        return error                        # (a NonFinite, a ValueError: what they say matters more)
    _, name, silent = alarmed
    out = RuntimeError(f"{_PREFIX}: {run._names([name])} sent no heartbeat for {silent:.1f} s and its liveness "
                       f"connection, if any, answered no ping (timeout {run._timeout:g} s): the generation's "
                       "process groups were aborted")
    out.__cause__ = error
    return out
