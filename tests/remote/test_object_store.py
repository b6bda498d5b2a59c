"""Object storage and tiering against a real S3 endpoint on loopback (moto server, real s3fs over HTTP)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import safepoint
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.s3store import S3Store
from safepoint.remote.upload import FileCopy, TransferOptions, UploadError
from safepoint.store.posix_layout import Layout
from tests.conftest import PYTHON, REPO, SUBPROCESS_ENV
from tests.helpers.s3 import FaultProxy, storage_options
from tests.helpers.train import Setup, assert_bitwise_equal, seed_everything

MiB = 1024 * 1024


def _fs(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **storage_options(endpoint))


def _keys(endpoint: str, prefix: str) -> list[str]:
    fs = _fs(endpoint)
    try:
        keys = (p[len(prefix) + 1 :] for p in fs.find(prefix))
        return sorted(k for k in keys if not k.startswith(".run/"))  # the run journal: test_report_url.py
    except FileNotFoundError:
        return []


def _train(mgr: safepoint.CheckpointManager, s: Setup, steps: range) -> None:
    for step in steps:
        s.step()
        mgr.maybe_save(step, s.state())


def test_round_trip_direct_to_s3(moto_endpoint: str, bucket: str) -> None:
    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    s = Setup()
    with safepoint.CheckpointManager(
        url, storage_options=opts, save_every_steps=2, keep=safepoint.Keep(last=2)
    ) as mgr:
        assert mgr.restore(s.state()) == 0
        _train(mgr, s, range(1, 7))
        mgr.wait()  # retention's deletes run on the deleter thread
        assert [i.step for i in mgr.list()] == [4, 6]
        assert mgr.list()[-1].path == f"{url}/step-6"
    snap = s.snapshot()
    keys = _keys(moto_endpoint, f"{bucket}/run")
    assert {"step-6/safepoint.json", "step-6/.metadata", "step-6/__0_0.distcp"} <= set(keys)
    assert not any(k.startswith("step-2/") for k in keys), "retention removes every object of a step"
    assert ".lease" not in keys, "the S3 lease is released on close"
    # Every object carries the CRC32C the store keeps for it, equal to the manifest's.
    layout = RemoteLayout(url, opts)
    m = layout.read_manifest(6)
    for name, entry in m.files.items():
        head = _fs(moto_endpoint).call_s3(
            "head_object", Bucket=bucket, Key=f"run/step-6/{name}", ChecksumMode="ENABLED"
        )
        assert base64.b64decode(head["ChecksumCRC32C"]).hex() == entry.crc32c, name

    seed_everything(7)
    s2 = Setup(seed=3)
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        assert mgr.restore(s2.state()) == 6
    assert_bitwise_equal(snap, s2.snapshot())


_RESTORE_CHILD = textwrap.dedent(
    """
    import json, sys, torch, safepoint
    from tests.helpers.train import Setup
    url, endpoint = sys.argv[1], sys.argv[2]
    opts = {"client_kwargs": {"endpoint_url": endpoint}}
    s = Setup(seed=11)
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        step = mgr.restore(s.state())
    print(json.dumps({"step": step, "sum": {k: float(v.double().sum()) for k, v in s.snapshot().items()}}))
    """
)


def test_restore_from_a_new_process(moto_endpoint: str, bucket: str) -> None:
    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    s = Setup()
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        _train(mgr, s, range(1, 4))
        mgr.save(3, s.state())
    out = subprocess.run(
        [PYTHON, "-c", _RESTORE_CHILD, url, moto_endpoint],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["step"] == 3
    assert got["sum"] == {k: float(v.double().sum()) for k, v in s.snapshot().items()}


def test_tiered_save_then_local_copy_lost_restores_from_s3(
    tmp_path: Path, moto_endpoint: str, bucket: str
) -> None:
    url, opts, local = f"s3://{bucket}/run", storage_options(moto_endpoint), tmp_path / "nvme"
    s = Setup()
    with safepoint.CheckpointManager(url, local_root=local, storage_options=opts, save_every_steps=2) as mgr:
        _train(mgr, s, range(1, 5))
        mgr.wait()
        assert mgr.durability_lag().durable_step == 4
        assert Layout(local).committed_steps() == [4], "keep_local_last=1 once the uploads are durable"
    assert RemoteLayout(url, opts).committed_steps() == [2, 4]
    snap = s.snapshot()
    shutil.rmtree(local)  # the node is gone

    s2 = Setup(seed=5)
    with safepoint.CheckpointManager(url, local_root=local, storage_options=opts) as mgr:
        assert mgr.restore(s2.state()) == 4
    assert_bitwise_equal(snap, s2.snapshot())
    assert Layout(local).committed_steps() == [4], "downloaded into the local tier, verified, committed"


def test_local_copy_corrupt_uses_the_durable_copy(tmp_path: Path, moto_endpoint: str, bucket: str) -> None:
    url, opts, local = f"s3://{bucket}/run", storage_options(moto_endpoint), tmp_path / "nvme"
    s = Setup()
    with safepoint.CheckpointManager(
        url, local_root=local, storage_options=opts, keep=safepoint.Keep(local_last=2)
    ) as mgr:
        for step in (1, 2):
            s.step()
            mgr.save(step, s.state())
    snap = s.snapshot()
    data = local / "step-2" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    s2 = Setup(seed=5)
    with pytest.warns(safepoint.CheckpointWarning, match="step 2"):
        with safepoint.CheckpointManager(url, local_root=local, storage_options=opts) as mgr:
            assert mgr.restore(s2.state()) == 2, "the intact durable step 2, not the older local step 1"
    assert_bitwise_equal(snap, s2.snapshot())


def test_uploader_killed_mid_upload(
    tmp_path: Path, proxy: FaultProxy, moto_endpoint: str, bucket: str
) -> None:
    url, local = f"s3://{bucket}/run", tmp_path / "nvme"
    proxy.add("hold", method="PUT", path=r"/run/step-2/__0_0\.distcp")
    child = subprocess.Popen(
        [
            PYTHON,
            str(REPO / "tests" / "helpers" / "procs" / "tiered_child.py"),
            str(local),
            url,
            proxy.endpoint,
            "2",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proxy.held.wait(60), "the upload of step 2 never started"
        os.kill(child.pid, signal.SIGKILL)  # mid-upload: a data object is in flight
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    proxy.clear()  # the held request now reaches the store: an orphan object, no manifest
    opts = storage_options(moto_endpoint)
    remote = RemoteLayout(url, opts)
    time.sleep(0.5)
    assert remote.committed_steps() == [1], "no committed remote checkpoint for the interrupted upload"
    assert Layout(local).committed_steps() == [1, 2] or Layout(local).committed_steps() == [2]

    # The next run resumes from the local copy and makes it durable (the uploader picks it up again).
    state = safepoint.TrainState(model=torch.nn.Linear(64, 64), extra={"step": 0})
    with safepoint.CheckpointManager(url, local_root=local, storage_options=opts) as mgr:
        assert mgr.restore(state) == 2
        mgr.wait()
        assert mgr.durability_lag().durable_step == 2
    assert remote.committed_steps() == [1, 2]
    remote.verify(2)
    # ... and with the local disk lost as well, from the previous remote checkpoint.
    shutil.rmtree(local)
    RemoteLayout(url, opts).remove(2)
    with safepoint.CheckpointManager(url, local_root=local, storage_options=opts) as mgr:
        assert mgr.restore(state) == 1
    assert float(state.model.weight[0, 0].detach()) == 1.0  # type: ignore[union-attr]


def test_transient_errors_are_retried(tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    url, opts = f"s3://{bucket}/run", storage_options(proxy.endpoint)
    proxy.add("503", method="PUT", path=r"/step-1/", count=3)
    proxy.add("reset", method="PUT", path=r"/step-1/", count=2)
    proxy.add("503", method="HEAD", count=1)
    s = Setup()
    with safepoint.CheckpointManager(
        url, local_root=tmp_path / "l", storage_options=opts, transfer=safepoint.TransferOptions(attempts=9)
    ) as mgr:
        s.step()
        mgr.save(1, s.state())
        mgr.wait()
        assert mgr.durability_lag().durable_step == 1
    assert proxy.faults() == 6
    RemoteLayout(url, storage_options(proxy.endpoint)).verify(1)


def test_persistent_errors_fail_clearly_and_commit_nothing(
    tmp_path: Path, proxy: FaultProxy, bucket: str
) -> None:
    url, opts, local = f"s3://{bucket}/run", storage_options(proxy.endpoint), tmp_path / "l"
    s = Setup()
    with safepoint.CheckpointManager(
        url, local_root=local, storage_options=opts, transfer=safepoint.TransferOptions(attempts=3)
    ) as mgr:
        s.step()
        mgr.save(1, s.state())
        mgr.wait()
        proxy.add("503", method="PUT", path=r"/step-2/__0_0\.distcp")
        s.step()
        mgr.save(2, s.state())  # the local commit succeeds: training goes on
        with pytest.raises(UploadError) as err:
            mgr.wait()
        msg = str(err.value)
        assert "__0_0.distcp" in msg and "after 3 attempts" in msg and "SlowDown" in msg, msg
        assert "nothing was committed" in msg and "local copy is kept" in msg, msg
        assert mgr.durability_lag().durable_step == 1
        mgr.wait()  # raised once
    proxy.clear()
    assert RemoteLayout(url, storage_options(proxy.endpoint)).committed_steps() == [1]
    assert Layout(local).committed_steps() == [1, 2] or Layout(local).committed_steps() == [2]
    assert 2 in Layout(local).committed_steps(), "a local copy is never deleted before it is durable"


def test_direct_save_failure_commits_nothing(proxy: FaultProxy, bucket: str) -> None:
    url, opts = f"s3://{bucket}/run", storage_options(proxy.endpoint)
    s = Setup()
    with safepoint.CheckpointManager(
        url, storage_options=opts, transfer=safepoint.TransferOptions(attempts=2)
    ) as mgr:
        s.step()
        mgr.save(1, s.state())
        proxy.add("503", method="PUT", path=r"/step-2/")
        with pytest.raises(safepoint.SaveError, match="not committed"):
            mgr.save(2, s.state())
        proxy.clear()
        assert [i.step for i in mgr.list()] == [1]
    assert RemoteLayout(url, opts).committed_steps() == [1]


def test_durable_retention_and_keep_local_last(tmp_path: Path, moto_endpoint: str, bucket: str) -> None:
    url, opts, local = f"s3://{bucket}/run", storage_options(moto_endpoint), tmp_path / "l"
    s = Setup()
    keep = safepoint.Keep(last=2, every_steps=10, local_last=2)
    with safepoint.CheckpointManager(url, local_root=local, storage_options=opts, keep=keep) as mgr:
        for step in (10, 11, 12, 13):
            s.step()
            mgr.save(step, s.state())
            mgr.wait()
    assert RemoteLayout(url, opts).committed_steps() == [10, 12, 13], "keep_last=2 + milestone every 10"
    assert Layout(local).committed_steps() == [12, 13]
    with safepoint.CheckpointManager(url, local_root=local, storage_options=opts, keep=keep) as mgr:
        assert [i.step for i in mgr.list()] == [10, 12, 13]


def test_keep_local_last_never_deletes_before_the_upload_commits(
    tmp_path: Path, proxy: FaultProxy, bucket: str
) -> None:
    url, opts, local = f"s3://{bucket}/run", storage_options(proxy.endpoint), tmp_path / "l"
    proxy.add("hold", method="PUT", path=r"/step-1/__0_0\.distcp")
    s = Setup()
    with safepoint.CheckpointManager(
        url, local_root=local, storage_options=opts, keep=safepoint.Keep(local_last=1)
    ) as mgr:
        for step in (1, 2, 3):
            s.step()
            mgr.save(step, s.state())
        assert proxy.held.wait(30)
        lag = mgr.durability_lag()
        assert (lag.durable_step, lag.steps, lag.uploads_pending) == (None, 3, 3)
        assert Layout(local).committed_steps() == [1, 2, 3], "nothing durable yet: every local copy stays"
        assert RemoteLayout(url, opts).committed_steps() == []
        proxy.clear()
        mgr.wait()
        assert mgr.durability_lag().durable_step == 3
    assert RemoteLayout(url, opts).committed_steps() == [1, 2, 3]
    assert Layout(local).committed_steps() == [3]


def test_durability_lag(tmp_path: Path, proxy: FaultProxy, bucket: str) -> None:
    url, opts = f"s3://{bucket}/run", storage_options(proxy.endpoint)
    s = Setup()
    with safepoint.CheckpointManager(
        url, local_root=tmp_path / "l", storage_options=opts, save_every_steps=5
    ) as mgr:
        _train(mgr, s, range(1, 6))
        mgr.wait()
        assert mgr.durability_lag().durable_step == 5
        proxy.add("hold", method="PUT", path=r"/step-10/")
        _train(mgr, s, range(6, 13))
        lag = mgr.durability_lag()
        assert (lag.steps, lag.durable_step, lag.uploads_pending) == (7, 5, 1)
        assert lag.seconds > 0
        proxy.clear()
        mgr.wait()
        lag = mgr.durability_lag()
        assert (lag.steps, lag.durable_step, lag.uploads_pending) == (2, 10, 0)
    # One tier (a URL root written directly): the newest checkpoint is the durable one.
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        mgr.maybe_save(14, s.state())
        assert mgr.durability_lag().durable_step == 10 and mgr.durability_lag().steps == 4


def test_multipart_upload_is_checked_by_the_store(tmp_path: Path, moto_endpoint: str, bucket: str) -> None:
    fs = _fs(moto_endpoint)
    store = S3Store(fs, TransferOptions(part_size=5 * MiB, concurrency=4, full_object_checksum=True))
    big = tmp_path / "big.bin"
    data = os.urandom(12 * MiB + 3)
    big.write_bytes(data)
    crc = f"{crc32c.crc32c(data):08x}"
    store.put_files([FileCopy(str(big), f"{bucket}/x/big.bin", len(data), crc)])
    head = fs.call_s3("head_object", Bucket=bucket, Key="x/big.bin", ChecksumMode="ENABLED")
    assert head["ChecksumType"] == "FULL_OBJECT"  # moto computed it over the assembled object
    assert base64.b64decode(head["ChecksumCRC32C"]).hex() == crc
    assert store.read_crc(f"{bucket}/x/big.bin", len(data)) == crc
    # A local file that no longer matches its manifest is never uploaded (multipart or not).
    for name, size in (("rot.bin", len(data)), ("small.bin", 1000)):
        p = tmp_path / name
        p.write_bytes(data[:size])
        wrong = f"{crc32c.crc32c(data[:size]) ^ 1:08x}"
        with pytest.raises(UploadError, match="no longer matches its manifest"):
            store.put_files([FileCopy(str(p), f"{bucket}/x/{name}", size, wrong)])
        assert not fs.exists(f"{bucket}/x/{name}")
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
    # Composite checksums (for S3-compatible stores without full-object ones): checked per part and as a
    # whole against the parts' checksums; verifying the stored object later reads it.
    composite = S3Store(fs, TransferOptions(part_size=5 * MiB, full_object_checksum=False))
    composite.put_files([FileCopy(str(big), f"{bucket}/x/c.bin", len(data), crc)])
    head = fs.call_s3("head_object", Bucket=bucket, Key="x/c.bin", ChecksumMode="ENABLED")
    assert head["ChecksumType"] == "COMPOSITE"
    assert composite.stored_checksum(f"{bucket}/x/c.bin") == (len(data), None)
    assert composite.check(f"{bucket}/x/c.bin", len(data), crc) is None
    assert "crc32c" in (composite.check(f"{bucket}/x/c.bin", len(data), f"{int(crc, 16) ^ 1:08x}") or "")


def test_corrupt_remote_object_falls_back(moto_endpoint: str, bucket: str) -> None:
    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    s = Setup()
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        for step in (1, 2):
            s.step()
            mgr.save(step, s.state())
    fs = _fs(moto_endpoint)
    key = f"{bucket}/run/step-2/__0_0.distcp"
    raw = bytearray(fs.cat_file(key))
    raw[100] ^= 1
    fs.pipe_file(key, bytes(raw))  # same size, no store checksum: verification reads the bytes
    with pytest.warns(safepoint.CheckpointWarning, match=r"step 2, file '__0_0.distcp': crc32c"):
        with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
            assert mgr.restore(Setup().state()) == 1


def test_resaving_a_committed_step_and_interrupted_replacement(moto_endpoint: str, bucket: str) -> None:
    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    s = Setup()
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        s.step()
        mgr.save(3, s.state(), metrics={"loss": 1.0})
        s.step()
        mgr.save(3, s.state(), metrics={"loss": 0.5}, overwrite=True)  # staged under .pending, then promoted
        assert mgr.list()[-1].metrics == {"loss": 0.5}
    assert _keys(moto_endpoint, f"{bucket}/run") == [
        "step-3/.metadata",
        "step-3/__0_0.distcp",
        "step-3/rank-0.fingerprints",  # the incremental record (remote/incremental_copy.py)
        "step-3/rank-0.state",
        "step-3/safepoint.json",
    ]
    # A process that died mid-promotion leaves the staged copy (with its manifest) and no final manifest:
    # the next owner finishes the job.
    fs = _fs(moto_endpoint)
    for name in (".metadata", "__0_0.distcp", "rank-0.fingerprints", "rank-0.state", "safepoint.json"):
        fs.copy(f"{bucket}/run/step-3/{name}", f"{bucket}/run/.pending/step-3-abc123/{name}")
    fs.rm(f"{bucket}/run/step-3/safepoint.json")
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        assert [i.step for i in mgr.list()] == [3]
        assert mgr.restore(Setup(seed=2).state()) == 3
    assert not any(k.startswith(".pending") for k in _keys(moto_endpoint, f"{bucket}/run"))


def test_second_writer_on_an_s3_root_is_refused(moto_endpoint: str, bucket: str) -> None:
    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    with safepoint.CheckpointManager(url, storage_options=opts):
        with pytest.raises(safepoint.LeaseError, match="already held by another open CheckpointManager"):
            safepoint.CheckpointManager(url + "/", storage_options=opts)
        with pytest.raises(safepoint.LeaseError, match="in use by pid"):  # the lease refuses as well
            RemoteLayout(url, opts).lease(120.0).acquire()
    with safepoint.CheckpointManager(url, storage_options=opts):  # released on close
        pass


def test_any_fsspec_url_as_durable_tier(tmp_path: Path) -> None:
    """The generic (non-S3) path: file:// as the durable tier, through the same commit protocol."""
    url, local = f"file://{tmp_path / 'durable'}", tmp_path / "local"
    s = Setup()
    with safepoint.CheckpointManager(
        url, local_root=local, save_every_steps=1, keep=safepoint.Keep(last=2)
    ) as mgr:
        _train(mgr, s, range(1, 4))
        mgr.wait()
    assert RemoteLayout(url).committed_steps() == [2, 3]
    RemoteLayout(url, deep_verify=True).verify(3)
    snap = s.snapshot()
    shutil.rmtree(local)
    s2 = Setup(seed=9)
    with safepoint.CheckpointManager(url, local_root=local) as mgr:
        assert mgr.restore(s2.state()) == 3
    assert_bitwise_equal(snap, s2.snapshot())


# A torchrun launch: ~15 s on 2 busy cores. The default suite runs the single-rank versions:
# test_round_trip_direct_to_s3, tests/remote/test_incremental_direct.py and test_incremental_upload.py.
@pytest.mark.slow
def test_two_ranks_each_upload_their_own_files(
    tmp_path: Path, proxy: FaultProxy, moto_endpoint: str, bucket: str
) -> None:
    """Tiered, then straight to the bucket, then incremental straight to the bucket, in one 2-rank job
    (tests/helpers/procs/tiered_dist_worker.py)."""
    url, local, saved = f"s3://{bucket}/run", tmp_path / "local", tmp_path / "saved"
    saved.mkdir()
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    worker = [
        str(REPO / "tests" / "helpers" / "procs" / "tiered_dist_worker.py"),
        str(local),
        url,
        moto_endpoint,
        proxy.endpoint,
        str(saved),
    ]
    out = subprocess.run(
        cmd + worker,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        # this tree's code in the ranks (REPO alone would import the venv's editable install)
        env={**os.environ, "PYTHONPATH": SUBPROCESS_ENV["PYTHONPATH"]},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RANK 0 DURABLE 2 PENDING 0" in out.stdout and "RANK 1 DURABLE 2 PENDING 0" in out.stdout, (
        out.stdout
    )
    remote = RemoteLayout(url, storage_options(moto_endpoint))
    assert remote.committed_steps() == [2], "durable retention keep_last=1"
    manifest = remote.verify(2)
    # Rank 1's data file of step 2 is a stable group (``__1_<n>.distcp``, n >= 10**18: its share of the
    # tensors did not change since step 1, store/incremental.py).
    rank1 = [n for n in manifest.files if n.startswith("__1_") and n.endswith(".distcp")]
    assert manifest.world_size == 2 and {"__0_0.distcp", ".metadata"} <= set(manifest.files) and rank1
    # Rank 1's requests went through the proxy: it uploaded its own file and nothing else; rank 0 (direct
    # to the store) uploaded the rest and wrote the manifest once both ranks' files were confirmed.
    puts = {path.split("?")[0].rsplit("/", 1)[1] for method, path, _ in proxy.seen if method == "PUT"}
    assert set(rank1) <= puts
    assert not puts & {"__0_0.distcp", ".metadata", "safepoint.json"}, puts
    assert Layout(local).committed_steps() == [2]
    assert "RANK 0 DIRECT OK" in out.stdout and "RANK 1 DIRECT OK" in out.stdout, out.stdout
    direct = RemoteLayout(url + "-direct", storage_options(moto_endpoint)).verify(7)
    assert direct.world_size == 2 and {"__0_0.distcp", "__1_0.distcp"} <= set(direct.files)
    assert "RANK 0 INCREMENTAL OK" in out.stdout and "RANK 1 INCREMENTAL OK" in out.stdout, out.stdout
    _check_incremental_ranks(url + "-incremental", moto_endpoint, saved, tmp_path)


def _check_incremental_ranks(url: str, endpoint: str, saved: Path, tmp: Path) -> None:
    """The worker's incremental saves straight to the bucket on 2 ranks (``incremental`` there): from the
    third save on each rank's unchanged frozen tensor is copied server-side (what the rank sent, counted by
    its own TCP proxy, is the changed bytes and a small overhead); rank 1's frozen tensor, changed at step
    CHANGED, is written again (then into a stable group of its own, then copied); and every step,
    downloaded alone, loads bit for bit with plain ``dcp.load`` and with safepoint."""
    import torch.distributed.checkpoint as dcp

    from safepoint.store.incremental import is_stable_group
    from tests.helpers.procs.tiered_dist_worker import CHANGED, FROZEN, MOVING, STEPS

    sent = {
        r: {int(s): n for s, n in json.loads((saved / f"sent.{r}.json").read_text()).items()} for r in (0, 1)
    }
    # What a save may send besides the changed bytes (.metadata, the rank's fingerprint record, rank 0's
    # manifest, the lease's heartbeat, the requests themselves), as in test_incremental_direct.py.
    small = MOVING * 4 + 256 * 1024
    for r in (0, 1):
        frozen = (r + 1) * FROZEN
        assert sent[r][1] > frozen and sent[r][2] > frozen, (r, sent[r])  # written; into a stable group
        assert sent[r][3] < small, (r, sent[r])  # copied by the store, no client bytes
    assert max(sent[0][s] for s in STEPS[3:]) < small, sent[0]  # rank 0's group copied every time
    # Rank 1's frozen tensor changed: written at CHANGED (and until it is in a stable group again: the
    # save after a write seen by the version counter has no fingerprint to compare with), then copied again.
    assert sent[1][CHANGED] > 2 * FROZEN and sent[1][STEPS[-1]] < small, sent[1]
    layout = RemoteLayout(url, storage_options(endpoint))
    assert layout.committed_steps() == list(STEPS)
    fs = _fs(endpoint)
    groups: dict[int, dict[str, str]] = {}
    for step in STEPS:
        manifest = layout.verify(step)
        assert manifest.world_size == 2
        groups[step] = {n[2]: n for n in manifest.files if is_stable_group(n)}
        want = {k: v for r in (0, 1) for k, v in torch.load(saved / f"rank{r}-step{step}.pt").items()}
        alone = tmp / f"alone-{step}" / f"step-{step}"
        fs.get(f"{layout.step_key(step)}/", f"{alone}/", recursive=True)
        sd = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
        dcp.load(sd, checkpoint_id=str(alone))
        for k, v in want.items():
            assert torch.equal(sd["model"][k], v), (step, k)
        module = torch.nn.Module()
        for k, v in want.items():
            module.register_parameter(k, torch.nn.Parameter(torch.zeros_like(v), requires_grad=False))
        with safepoint.CheckpointManager(alone.parent) as mgr:
            assert mgr.restore(safepoint.TrainState(model=module, rng=False)) == step
        for k, v in want.items():
            assert torch.equal(module.state_dict()[k], v), (step, k)
    # Each rank's stable group is there from step 2 on; rank 0's is the same group throughout (copied under
    # its name), rank 1's is a new one after its frozen tensor changed.
    assert set(groups[2]) == set(groups[3]) == {"0", "1"} and not groups[1], groups
    assert len({groups[s]["0"] for s in STEPS[1:]}) == 1, groups
    assert "1" not in groups[CHANGED] and groups[STEPS[-1]]["1"] != groups[3]["1"], groups


def test_cli_ls_and_verify_read_s3_urls(
    moto_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from safepoint.cli import main as cli

    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    s = Setup()
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        for step in (1, 2):
            s.step()
            mgr.save(step, s.state(), metrics={"loss": float(step)})
    fs = _fs(moto_endpoint)
    fs.pipe_file(f"{bucket}/run/step-3/__0_0.distcp", b"partial")  # an upload that never committed
    key = f"{bucket}/run/step-2/__0_0.distcp"
    raw = bytearray(fs.cat_file(key))
    raw[-1] ^= 1
    fs.pipe_file(key, bytes(raw))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)  # the CLI takes endpoints from the environment
    import json

    assert cli.main(["ls", url, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert {s: (r["status"], r["tier"]) for s, r in rows.items()} == {
        1: ("ok", "durable"),
        2: ("ok", "durable"),
        3: ("partial", "durable"),
    }
    assert cli.main(["verify", url, "--all"]) == 1
    out = capsys.readouterr().out
    assert "ok      step 1" in out and "CORRUPT step 2: __0_0.distcp: crc32c" in out, out


def test_durable_retention_keeps_the_newest_verified(tmp_path: Path, moto_endpoint: str, bucket: str) -> None:
    """Steps 10 and 20 are durable, 20 rots in both tiers. A keep_last=1 restart restores 10 and saves 15:
    15 is uploaded (not "superseded" by the corrupt 20), 10 (the newest verified) survives durable retention,
    and the corrupt 20 is left alone. The old rule kept only the corrupt 20, and a restart began at 0."""
    url, opts, local = f"s3://{bucket}/run", storage_options(moto_endpoint), tmp_path / "l"
    kw: dict[str, Any] = dict(
        local_root=local, storage_options=opts, keep=safepoint.Keep(last=1, local_last=2)
    )
    s = Setup()
    with safepoint.CheckpointManager(url, local_root=local, storage_options=opts) as mgr:  # keeps all
        for step in (10, 20):
            s.step()
            mgr.save(step, s.state())
            mgr.wait()
    assert RemoteLayout(url, opts).committed_steps() == [10, 20]
    data = local / "step-20" / "__0_0.distcp"
    rotten = bytearray(data.read_bytes())
    rotten[len(rotten) // 2] ^= 0xFF
    data.write_bytes(bytes(rotten))
    _fs(moto_endpoint).pipe(f"{bucket}/run/step-20/__0_0.distcp", bytes(rotten))
    s2 = Setup()
    with pytest.warns(UserWarning, match="step 20"):
        with safepoint.CheckpointManager(url, **kw) as mgr:
            assert mgr.restore(s2.state()) == 10
            s2.step()
            mgr.save(15, s2.state())
            mgr.wait()
    assert RemoteLayout(url, opts).committed_steps() == [10, 15, 20]


def test_object_replaced_after_verify_is_not_loaded(moto_endpoint: str, bucket: str) -> None:
    """Data objects are checked as they are read, like local files: an object replaced between verification
    and the load (same size, other values) is found and the restore falls back."""
    from safepoint.dist import Comm
    from safepoint.restore.restorer import Restorer

    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    other = f"s3://{bucket}/other"
    s = Setup()
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        for step in (1, 2):
            s.step()
            mgr.save(step, s.state())
    with safepoint.CheckpointManager(other, storage_options=opts) as mgr:
        s.step()
        mgr.save(2, s.state())  # same shapes, other values
    layout = RemoteLayout(url, opts)
    restorer = Restorer(layout, Comm(60))
    manifest = restorer.choose(None)
    assert manifest is not None and manifest.step == 2
    fs = _fs(moto_endpoint)
    fs.pipe(f"{bucket}/run/step-2/__0_0.distcp", fs.cat(f"{bucket}/other/step-2/__0_0.distcp"))
    with pytest.raises(safepoint.CorruptCheckpointError, match="__0_0.distcp.*as read"):
        restorer.load(manifest, Setup().state())
