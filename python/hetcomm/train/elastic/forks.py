"""Guards of an elastic run's epochs against forks (a mixin of `Epochs`): two sets of members each
deciding an epoch without the other, each training on in a generation of its own. A store writer
alone can delete and replay sealed records, not forge them; what it cannot hide is a member's
answer on its liveness connection (`hetcomm.train.pulse.Pulse`), sealed with the secret. So a
member is left out only where its silence can count (`Pulse.evidence`, `_unreached`), an epoch another member
says it holds decided is not decided again (`_decided_before`, `_decided_without_me`), and a
worker that holds a decision another holds a rival of stops before its generation forms
(`_check_no_rival`). docs/elastic-protocol.md#an-epoch-step-by-step, docs/security.md."""
from __future__ import annotations

import time

from hetcomm.train.elastic.common import _PREFIX, _digest, _read_decision, _read_int
from hetcomm.train.membership import Keys, SecretMismatch
from hetcomm.train.pulse import Pulse


class ForkGuards:
    """(uses `Epochs`' ``_pulse``, ``_era_number``, ``_heartbeat``, ``_me`` and ``_names``)"""

    def _unreached(self, epoch: int, names: list[str], waited: float) -> None:
        """Raises once members to be left out of ``epoch`` have stayed without evidence
        (`Pulse.evidence`) for longer than two of the heartbeat's connection attempts take."""
        if waited > 2 * Pulse.RETRY + 2 * self._heartbeat + Pulse.GREETING:
            raise RuntimeError(f"{_PREFIX}: epoch {epoch}: {self._names(names)} look gone (silent, or not at the "
                               "epoch), but this worker never had a liveness connection to them (their address in "
                               "the store, addr/<worker>, never read: someone may keep deleting it; or their "
                               "liveness port unreachable from here: a firewall, or someone holding its "
                               "connections). Not deciding without them: a store writer who also holds their "
                               "heartbeats back could have two sets of members each decide alone (a fork). Make "
                               "the liveness ports reachable (HETCOMM_LISTEN_IP) and check the store's access, then "
                               "restart the job from checkpoints")

    def _await_fresh_answers(self, names: list[str]) -> None:
        """Waits until each of ``names`` whose liveness connection is verified has answered a ping
        sent from now on, is linked no more, or left the newest such ping unanswered for a
        heartbeat and a second of the link thread's reading (two heartbeats and a second in all,
        where no thread of this process stalls: counted by the link thread, so that a freeze of
        this process inside the wait does not end it without a ping sent after the freeze)."""
        since = time.monotonic()
        while True:
            self._pulse.check()
            pending = [m for m in names if self._pulse.linked(m) and not self._pulse.answered_since(m, since)]
            if all(self._pulse.unanswered_since(m, since, self._heartbeat + 1.0) for m in pending):
                return
            time.sleep(min(0.05, self._heartbeat / 4))

    def _decided_without_me(self, keys: Keys, epoch: int, decision: dict) -> dict:
        """Epoch ``epoch``'s decision, decided without this worker and gone from the store: read
        once more, else ``decision`` with no members, this worker counted out (it joins again)."""
        again = _read_decision(keys, epoch)
        return again if again is not None else {
            **decision, "members": [], "holders": [],
            "left": {self._me: f"epoch {epoch} was decided without it (its decision is gone from the store)"}}

    def _decided_before(self, keys: Keys, epoch: int) -> bool:
        """Whether epoch ``epoch`` has been decided: ``latest`` (written after a decision, and
        kept by its members' heartbeats) is at or past it, it has an outcome, or a worker that
        answered this one's ping said it holds it decided (`Pulse.reported`: where the liveness
        connections are verified, a store writer who deletes all three cannot hide it)."""
        if self._pulse.reported(self._era_number) >= epoch:
            return True
        latest = _read_int(keys, "latest")
        if latest is not None and latest >= epoch:
            return True
        try:
            return keys.peek(f"e{epoch}/outcome") is not None
        except SecretMismatch:
            raise
        except ValueError:
            return False

    def _check_no_rival(self, decision: dict) -> None:
        """Raises when a worker that ``decision`` left out, and that answers on its liveness
        connection, holds another decision of the same epoch (or a later epoch of the era).

        Two decisions of one epoch exist only where a store writer deleted the first before the
        second was written: each side could then train on in a generation of its own (a fork).
        This worker's answers say which decision it holds from before this check (`Pulse.decided`),
        and the check waits for answers to pings sent after that; so of two workers that hold
        rival decisions and answer each other, the later to hold its decision sees the other's and
        stops here, before its generation forms."""
        epoch, mine = decision["epoch"], _digest(decision)
        linked = [m for m in decision["left"] if m != self._me and self._pulse.linked(m)]
        if not linked:
            return
        self._await_fresh_answers(linked)
        for m in linked:
            held = self._pulse.holding(m)
            if held is not None and held[0] == self._era_number and \
                    (held[1] > epoch or (held[1] == epoch and held[2] not in ("-", mine))):
                raise RuntimeError(f"{_PREFIX}: epoch {epoch}: {self._names([m])}, left out of this worker's "
                                   f"decision, holds another decision of epoch {held[1]} of the era: someone deleted "
                                   "records in the store so that two were written. Stopping before the generation "
                                   "forms (both going on would fork the run); check the store's access, then "
                                   "restart this worker from a checkpoint")
