"""A rogue store writer against a group of two sites under ``HETCOMM_TLS=inter-site`` (issue 43):
ranks 0 and 1 on site a, rank 2 on site b, each declaring its own site (``HETCOMM_SITE``, so the
ranks learn each other's from the store), every link on TCP. The rogue, this test's process,
swaps the site labels in the store so that both ends of each link between the sites would take
it for a link inside a site, and skip TLS.

With an out-of-band secret the swapped labels (each a sealed value moved to another rank's key)
fail their seal: every rank ignores them, the owners put their own back, and the links between
the sites are encrypted. Without one (the control) the same swap gives clear-text links between
the sites: the test can see the attack.

Every rank pauses between publishing its site label and its address
(``HETCOMM_TEST_PUBLISH_DELAY_MS``, a test seam): no peer can look a label up before the rank's
address is out, so the rogue's swap lands before any rank reads a label, as long as the ranks
publish their labels within the pause of each other (asserted: no address out before the swap). The owners first look at their records ``HETCOMM_FAILURE_POLL_MS`` after creation: the
ranks meet the swapped labels before any is put back.
"""
from __future__ import annotations

import datetime
import functools
import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from marks import hetcomm_only
from test_store_trust import _await, claim_rank_1

pytestmark = [pytest.mark.usefixtures("backend_importable"),
              hetcomm_only("attacks hetcomm's own store records")]

SECRET = "a test secret, long enough: 0123456789"
SITES = "aab"
WAIT_S = 60.0           # a guard against a hang, never the thing measured
PAUSE_MS = 4000         # between a rank's site label and its address: the rogue's window


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> str:
    import shutil

    import hetcomm
    from hetcomm import tls_certs

    ok, why = hetcomm.tls_available()
    if not ok:
        pytest.skip(f"OpenSSL 3 cannot be loaded here ({why}): TLS is unavailable")
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command-line tool (to make test certificates) is not installed")
    directory = str(tmp_path_factory.mktemp("certs"))
    names = [f"rank{r}" for r in range(len(SITES))]
    tls_certs.make(directory, names, hosts={n: ["127.0.0.1"] for n in names})
    return directory


def two_sites(rank: int, world_size: int, port: int, certs: str, attack: str) -> dict:
    from hetcomm import tls_certs

    os.environ.update(tls_certs.env_for(certs, f"rank{rank}", "inter-site"))
    os.environ.update({"HETCOMM_SITE": SITES[rank], "HETCOMM_LOCAL": "tcp"})
    if attack == "swap":
        os.environ.update({"HETCOMM_TEST_PUBLISH_DELAY_MS": str(PAUSE_MS), "HETCOMM_FAILURE_POLL_MS": "2000"})
    import hetcomm

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=WAIT_S))
    dist.init_process_group("hetcomm", store=dist.PrefixStore("job", store), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    # Every pair talks (a ring allgather and an allreduce), and the numbers are exact.
    out = [torch.empty(50_000) for _ in range(world_size)]
    dist.all_gather(out, torch.full((50_000,), float(rank)))
    assert all(torch.equal(out[r], torch.full((50_000,), float(r))) for r in range(world_size)), "wrong allgather"
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1000,), float(sum(range(1, world_size + 1))))), "wrong allreduce"
    if attack == "claim":
        if rank == 0:
            store.set("target", hetcomm.listen_address())
        _await(store, "rogue_done")
        dist.all_reduce(t)                     # the group goes on, whatever the rogue got
        assert torch.equal(t, torch.full((1000,), float(world_size * sum(range(1, world_size + 1))))), \
            "wrong allreduce after the rogue"
    with open(os.readlink("/proc/self/fd/2")) as f:
        log = f.read()
    return {"links": hetcomm.backend_of(dist.group.WORLD).link_security(),
            "ignored": "ignored the store's value of 'hetcomm/site/" in log,
            "rejected": hetcomm.backend_of(dist.group.WORLD).rejected_connections()}


def swap_the_labels(store) -> dict:
    """Once every rank's label is out (and before any address): rank 2's label under ranks 0 and
    1, rank 0's under rank 2. Each value is copied as it stands (sealed or not)."""
    pattern = re.compile(r"hetcomm/site/[0-9a-f]{16}/([0-9]+)$")
    deadline = time.monotonic() + WAIT_S
    keys: dict[int, str] = {}
    while len(keys) < len(SITES):
        assert time.monotonic() < deadline, f"the site labels did not appear within {WAIT_S} s: {keys}"
        for key in store.list_keys():
            m = pattern.search(key)
            if m:
                keys[int(m.group(1))] = key
        time.sleep(0.002)
    started = time.monotonic()
    values = {r: store.get(k) for r, k in keys.items()}
    store.set(keys[0], values[2])
    store.set(keys[1], values[2])
    store.set(keys[2], values[0])
    addresses = [k for k in store.list_keys() if re.search(r"hetcomm/addr/[0-9a-f]{16}/[0-9]+$", k)]
    return {"seconds": time.monotonic() - started, "addresses_out_before": addresses}


def _cross_site(results: list) -> list[int]:
    """The security state of each link between the sites, from both ends (1: TLS, 0: clear)."""
    return [results[r]["links"][p] for r in range(len(SITES)) for p in range(len(SITES)) if SITES[r] != SITES[p]]


class _Rogue(threading.Thread):
    """Runs ``act`` on a store client of its own beside the ranks; keeps what it returns or raises."""

    def __init__(self, port: int, act) -> None:
        super().__init__(daemon=True)
        self.port, self.act, self.result, self.error = port, act, None, None

    def run(self) -> None:
        try:
            self.result = self.act(dist.TCPStore("127.0.0.1", self.port, is_master=False,
                                                 timeout=datetime.timedelta(seconds=WAIT_S)))
        except BaseException as e:  # noqa: BLE001 - raised by finish() in the test
            self.error = e

    def finish(self):
        self.join(WAIT_S)
        assert not self.is_alive(), "the rogue did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def _attack(mode: str, certs: str, attack: str, act) -> tuple[list, object]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=WAIT_S))
    rogue = _Rogue(server.port, act)
    rogue.start()
    results = run_ranks(len(SITES), two_sites, server.port, certs, attack, init=None, timeout=180,
                        env={"HETCOMM_SECRET": SECRET if mode == "out_of_band" else None})
    return results, rogue.finish()


@pytest.mark.parametrize("mode", ["out_of_band", "in_store"])
def test_a_store_writer_swapping_site_labels_gets_no_clear_link_between_sites(certs, mode: str) -> None:
    results, swap = _attack(mode, certs, "swap", swap_the_labels)
    # The swap landed inside the window, before any address was published (so before any rank
    # could read a label: a run whose ranks started further apart than the window says so here).
    assert swap["addresses_out_before"] == [], swap
    links = _cross_site(results)
    assert len(links) == 4, results
    if mode == "out_of_band":
        assert links == [1, 1, 1, 1], f"a link between the sites is not encrypted: {results}"
        # Not vacuous: the ranks met the swapped labels and ignored them.
        assert any(r["ignored"] for r in results), results
        # ...and the link inside site a stays clear (the labels were read, not assumed).
        assert results[0]["links"][1] == 0 and results[1]["links"][0] == 0, results
    else:
        assert links == [0, 0, 0, 0], f"control: the swapped labels did not take effect: {results}"


@pytest.mark.parametrize("mode", ["out_of_band", "in_store"])
def test_a_rogue_on_the_other_site_claiming_a_rank_of_rank_0s_site_gets_no_clear_link(certs, mode: str) -> None:
    """Issue 43's first finding, acted out: a process on site b connects to rank 0 in clear text
    and claims rank 1, a rank of rank 0's own site, whose links are clear under inter-site. With
    the secret in the store (the control) it reads the secret, passes the handshake and is taken
    as rank 1 on a clear link; with an out-of-band secret it has nothing to prove its claim with,
    and rank 0 refuses it. The group goes on with exact numbers either way."""
    results, outcome = _attack(mode, certs, "claim", functools.partial(claim_rank_1, world_size=len(SITES)))
    assert _cross_site(results) == [1, 1, 1, 1], results
    if mode == "out_of_band":
        assert outcome == "refused (b'')", f"the rogue without the secret got: {outcome}"
        assert results[0]["rejected"] >= 1, "rank 0 did not count the rogue's connection as rejected"
    else:
        assert outcome == "accepted as rank 1", f"control: with the secret in the store the rogue got: {outcome}"
