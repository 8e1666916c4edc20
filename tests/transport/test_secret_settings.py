"""The out-of-band secret's settings end to end (issue 43): ranks whose secrets differ get a clear
error, and ``HETCOMM_SECRET_FILE`` (the other tests pass ``HETCOMM_SECRET``) forms the group over
a group record, or is refused when its group or others may write it."""
from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist

from harness import run_ranks
from marks import hetcomm_only
from test_store_trust import SECRET, WAIT_S, _client, _exact_allreduce

pytestmark = [pytest.mark.usefixtures("backend_importable"),
              hetcomm_only("the settings of hetcomm's out-of-band secret")]


# --- ranks that do not share the secret -----------------------------------------------------------

@pytest.mark.parametrize("rank1_secret", [None, SECRET + "-other"], ids=["none", "another"])
def test_ranks_that_do_not_share_the_secret_get_a_clear_error(rank1_secret) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=WAIT_S))
    outcomes = run_ranks(2, rank_specific_secret, server.port, rank1_secret, init=None, timeout=120,
                         env={"HETCOMM_SECRET": SECRET})
    want = "rank 0 has an out-of-band secret" if rank1_secret is None else "differs from rank 0's"
    assert want in outcomes[1], outcomes


def rank_specific_secret(rank: int, world_size: int, port: int, rank1_secret) -> str:
    if rank == 1:
        if rank1_secret is None:
            os.environ.pop("HETCOMM_SECRET")
        else:
            os.environ["HETCOMM_SECRET"] = rank1_secret
    store = _client(port)
    try:
        # Rank 1's timeout outlasts the patience for a record that never opens (10 s), which is
        # what must end its wait; rank 0 gives up on its own soon after.
        timeout = 30 if rank == 1 else (3 if rank1_secret is None else 12)
        dist.init_process_group("hetcomm", store=dist.PrefixStore("job", store), rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        return "joined"
    except Exception as e:  # noqa: BLE001
        return str(e)


# --- the secret from a file ------------------------------------------------------------------------

def formed_with_a_file(rank: int, world_size: int, port: int) -> str:
    store = _client(port)
    try:
        dist.init_process_group("hetcomm", store=dist.PrefixStore("job", store), rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=10))
    except Exception as e:  # noqa: BLE001 - what each rank saw is the result
        return str(e)
    _exact_allreduce(rank)
    secrets_published = [k for k in store.list_keys() if k.endswith("hetcomm/secret")]
    records = [k for k in store.list_keys() if k.endswith("hetcomm/record")]
    return f"formed; secrets {secrets_published}; records {len(records)}"


@pytest.mark.parametrize("mode", [0o600, 0o620], ids=["private", "group-writable"])
def test_a_secret_file_is_the_out_of_band_secret_and_a_loose_one_is_refused(tmp_path, mode: int) -> None:
    """``HETCOMM_SECRET_FILE`` end to end (the other tests pass ``HETCOMM_SECRET``): the group forms
    over a group record, no secret in the store; a file its group may write is refused on every
    rank, naming the file."""
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(mode)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=WAIT_S))
    outcomes = run_ranks(2, formed_with_a_file, server.port, init=None, timeout=120,
                         env={"HETCOMM_SECRET": None, "HETCOMM_SECRET_FILE": str(path)})
    if mode == 0o600:
        assert outcomes == ["formed; secrets []; records 1"] * 2, outcomes
    else:
        assert all(str(path) in o and "formed" not in o for o in outcomes), outcomes


def test_the_elastic_records_key_binds_the_job_id(monkeypatch):
    """The key that seals an elastic run's records, computed here from the documented derivation
    (hashlib): the secret's master key, then HMAC over the label, ``HETCOMM_JOB_ID`` and a zero byte
    where one is set (white space around it dropped), and the job's key prefix."""
    import hashlib
    import hmac

    from hetcomm._engine import store_seal_key

    monkeypatch.setenv("HETCOMM_SECRET", SECRET)
    master = hashlib.pbkdf2_hmac("sha256", SECRET.encode(), b"hetcomm out-of-band secret v1", 100000)

    def expected(scope: bytes) -> bytes:
        return hmac.new(master, b"hetcomm python store v1\0" + scope, hashlib.sha256).digest()

    monkeypatch.delenv("HETCOMM_JOB_ID", raising=False)
    assert store_seal_key("hetcomm/ft/diloco/") == expected(b"hetcomm/ft/diloco/")
    monkeypatch.setenv("HETCOMM_JOB_ID", " run-7\n")
    assert store_seal_key("hetcomm/ft/diloco/") == expected(b"run-7\0hetcomm/ft/diloco/")
