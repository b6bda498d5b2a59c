"""Failed and short reads (GET, HEAD, LIST) on an S3 root, through the fault proxy in front of moto: the
bugs the read-fault campaign (tests/torture/objreads.py) found, each pinned by a test of its own."""

from __future__ import annotations

import pytest
import torch

import safepoint
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.retry import TransferOptions, UploadError
from tests.helpers.s3 import FaultProxy, storage_options

_FAST = TransferOptions(attempts=2, backoff_s=0.0, client_retries=0)


def _state(value: float) -> safepoint.TrainState:
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return safepoint.TrainState(model=model)


def _commit(url: str, opts: dict[str, object], steps: list[int]) -> None:
    with safepoint.CheckpointManager(url, storage_options=opts, keep=safepoint.Keep(last=len(steps))) as m:
        for step in steps:
            m.save(step, _state(step))


def test_a_listing_that_leaves_out_a_manifest_deletes_no_committed_step(
    proxy: FaultProxy, bucket: str
) -> None:
    # A store whose listing lags or drops keys (an eventually consistent S3-compatible store, a proxy that
    # cuts pages) answers the new owner's cleanup with step 1's data objects but not its manifest. The
    # cleanup took step 1 for an interrupted save and deleted it, manifest first: a committed checkpoint
    # gone because a LIST came back short.
    url, opts = f"s3://{bucket}/run", storage_options(proxy.endpoint)
    _commit(url, opts, [1, 2])
    layout = RemoteLayout(url, opts, transfer=_FAST)
    lease = layout.lease(120.0)
    lease.acquire()
    try:
        proxy.add("short", method="GET", path=r"list-type=2&prefix=run%2F&", count=1)
        layout.clean_pending()
        assert proxy.faults() == 1
    finally:
        lease.release()
    proxy.clear()
    assert RemoteLayout(url, opts).committed_steps() == [1, 2]
    for step in (1, 2):
        RemoteLayout(url, opts).verify(step)


def test_a_start_that_failed_while_the_store_was_down_leaves_the_root_to_this_process(
    proxy: FaultProxy, bucket: str
) -> None:
    # The store fails every read of the lease: the new manager created its lease, then could not confirm
    # it (the cleanup's fence) and failed to start; giving the lease back failed too (the delete needs a
    # read). Once the store was back, the next manager in this same process found that lease, held by a
    # live process (this one), and refused the root: the job could not save again until it restarted.
    url, opts = f"s3://{bucket}/run", storage_options(proxy.endpoint)
    _commit(url, opts, [1])
    proxy.add("503", method="GET", path=r"/run/\.lease")
    with pytest.raises(safepoint.CheckpointError) as failed:
        safepoint.CheckpointManager(url, storage_options=opts, transfer=_FAST)
    assert "\n" not in str(failed.value) and "SlowDown" in str(failed.value)
    proxy.clear()
    with safepoint.CheckpointManager(url, storage_options=opts, transfer=_FAST) as mgr:
        assert mgr.restore(_state(0)) == 1
        assert mgr.save(2, _state(2)) is not None


def test_retention_goes_on_after_the_lease_could_not_be_read(proxy: FaultProxy, bucket: str) -> None:
    # Retention confirms the lease before each delete (the fence). The store failed those reads (503 after
    # every retry): the fence raised LeaseError ("cannot confirm this job still owns the root"), which
    # retention took for a lost lease and stopped for good. The job kept saving, nothing was ever deleted
    # again, and the bucket filled. An unreadable lease is a failed pass, retried after the next save.
    url, opts = f"s3://{bucket}/run", storage_options(proxy.endpoint)
    with safepoint.CheckpointManager(
        url, storage_options=opts, transfer=_FAST, keep=safepoint.Keep(last=1)
    ) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
        proxy.add("503", method="GET", path=r"/run/\.lease", skip=1)  # the commit's fence reads it once
        mgr.save(2, _state(2))
        mgr.wait()
        assert proxy.faults() >= 2, "retention's fence was not failed"
        assert RemoteLayout(url, opts).committed_steps() == [1, 2]  # step 1 could not be deleted yet
        proxy.clear()
        mgr.save(3, _state(3))
        mgr.wait()
        assert RemoteLayout(url, opts).committed_steps() == [3]


@pytest.mark.parametrize("command", ["verify", "ls"])
def test_the_cli_says_the_store_failed_never_that_an_intact_checkpoint_is_damaged(
    proxy: FaultProxy,
    bucket: str,
    command: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The store fails every read of step 2's manifest (503 past every retry). `safepoint verify` printed
    # "CORRUPT step 2: safepoint.json: cannot read manifest (...SlowDown...)" and exited 1 (a damaged
    # checkpoint), `ls` listed it as corrupt: a script that quarantines or deletes damaged checkpoints would
    # remove an intact one because the store was busy. It is an error of the store: exit 2, one line.
    url, opts = f"s3://{bucket}/run", storage_options(proxy.endpoint)
    _commit(url, opts, [1, 2])
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    proxy.add("503", method="GET", path=r"/run/step-2/safepoint\.json")
    # The CLI reaches the store through the environment's endpoint: an S3 file system fsspec cached for an
    # earlier test in this worker (the store's own endpoint, no proxy) would answer instead, and no fault
    # would be injected.
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    from safepoint.cli.main import main

    code = main([command, url])
    out = capsys.readouterr()
    assert "corrupt" not in out.out.replace("0 corrupt", "").lower(), out.out
    if command == "ls" and code == 0:
        return  # (ls read what it shows without that GET)
    assert code == 2, out.out + out.err
    errors = [line for line in out.err.splitlines() if line.startswith("safepoint: error:")]
    assert len(errors) == 1 and "SlowDown" in errors[0], out.err


def test_a_ranged_read_goes_through_the_retries_and_names_a_failing_store(
    proxy: FaultProxy, bucket: str
) -> None:
    # verify's item check and the incremental record's read-back read byte ranges (read_range) straight
    # through the file system, outside safepoint's retries: one 503 past the client's own retries made
    # verify report "CORRUPT ... cannot read the items it describes ([Errno 16] Please reduce your request
    # rate.)", and on gs:// gcsfs's HttpError (not an OSError) escaped a save as it read the previous
    # step's record. Now: retried under TransferOptions, then the store's UploadError (never damage).
    url, opts = f"s3://{bucket}/run", storage_options(proxy.endpoint)
    _commit(url, opts, [1])
    layout = RemoteLayout(url, opts, transfer=_FAST)
    name = sorted(n for n in layout.read_manifest(1).files if n.endswith(".distcp"))[0]
    proxy.add("503", method="GET", path=rf"/run/step-1/{name}", count=1)
    assert len(layout.read_range(1, name, 0, 8)) == 8  # one 503: retried
    proxy.add("503", method="GET", path=rf"/run/step-1/{name}")
    with pytest.raises(UploadError, match="failed after 2 attempts; last error: SlowDown"):
        layout.read_range(1, name, 0, 8)
