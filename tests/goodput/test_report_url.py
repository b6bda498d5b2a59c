"""``safepoint report s3://...``: the run journal of a bucket root (no local_root) is copied to ``ROOT/.run/``
by rank 0 (tiers/journal_mirror.py) and read back from the store as hostile input. Against a real S3
endpoint (moto server) and a real kill -9 of the job, checked against what was measured outside the job."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.cli.main import main as cli
from safepoint.policy.journal import MAX_JOURNAL_BYTES, read_journal
from tests.helpers.goodput_runs import run_worker
from tests.helpers.s3 import storage_options


def _run(args: list[str], endpoint: str, *, hang: bool) -> tuple[list[str], int]:
    # The journal is copied every 0.1 s in this job: a second after REACHED, step 13's progress is up.
    return run_worker(args, hang=hang, env={"GOODPUT_S3_ENDPOINT": endpoint}, settle_s=1.0)


def _saves(lines: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines if line.startswith("SAVE ")]


def _keys(endpoint: str, bucket: str) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run/.run/").get("Contents", []))


@pytest.mark.slow  # time bar of the default suite: the kill is tests/goodput/test_report_after_kill.py's by default; the URL copy's other tests run by default
def test_report_of_a_bucket_root_after_a_kill(
    moto_endpoint: str, bucket: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{bucket}/run"
    first, rc = _run([url, "30", "5", "13"], moto_endpoint, hang=True)
    assert rc == -signal.SIGKILL
    reached = int(next(line for line in first if line.startswith("REACHED")).split()[1])
    assert reached == 13
    second, _ = _run([url, "30", "5"], moto_endpoint, hang=False)
    restored = int(next(line for line in second if line.startswith("RESTORED")).split()[1])
    assert restored == 10
    saves = _saves(first) + _saves(second)
    assert saves == [5, 10, 15, 20, 25, 30]
    # The journal and the attempts file are objects of the root; the progress object went at the close.
    assert _keys(moto_endpoint, bucket) == ["run/.run/.attempts.json", "run/.run/.journal.jsonl"]

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)  # the CLI's endpoint, as a user sets it
    assert cli(["report", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["root"] == url
    assert report["attempts"] == 2 and report["restarts"] == 1
    assert report["saves"] == len(saves)
    assert report["steps_redone"] == reached - restored  # the killed job's progress came from its copy
    assert report["last_step"] == 30
    assert report["attempt_list"][1]["restored"] == restored
    assert 0 < report["goodput"] < 1


def test_the_report_reads_the_store_as_hostile_input(
    moto_endpoint: str, bucket: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    url = f"s3://{bucket}/run"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    assert cli(["report", url]) == 2  # nothing there: one line, no traceback
    assert "has no run journal" in capsys.readouterr().err
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    lines = [
        {"event_type": "save_committed", "step": 5, "rank": 0, "wall_time": 1000.0, "bytes_written": 10},
        {"event_type": "save_committed", "step": "six", "wall_time": 1001.0},  # wrong type: skipped
    ]
    body = "\n".join(json.dumps(r) for r in lines) + "\nnot json\n"
    s3.put_object(Bucket=bucket, Key="run/.run/.journal.jsonl", Body=body.encode())
    assert cli(["report", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["saves"] == 1 and report["skipped_lines"] == 2
    # An object over the cap is refused before it is downloaded.
    s3.put_object(Bucket=bucket, Key="run/.run/.journal.jsonl", Body=b"x" * (2 * MAX_JOURNAL_BYTES + 1))
    assert cli(["report", url]) == 2
    err = capsys.readouterr().err
    assert "over the" in err and "cap" in err and "Traceback" not in err


def test_a_new_node_with_an_empty_local_root_appends_to_the_roots_journal(
    tmp_path: Path, moto_endpoint: str, bucket: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    state = safepoint.TrainState(model=torch.nn.Linear(4, 4), rng=False)
    with safepoint.CheckpointManager(url, local_root=tmp_path / "a", storage_options=opts) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
    # Another node: its local disk holds nothing; the journal and attempts come down from the root first.
    with safepoint.CheckpointManager(url, local_root=tmp_path / "b", storage_options=opts) as mgr:
        assert mgr.restore(state) == 2
        mgr.save(3, state)
    local, _ = read_journal(tmp_path / "b")
    assert [r["step"] for r in local if r["event_type"] == "save_committed"] == [1, 2, 3]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    assert cli(["report", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["attempts"] == 2 and report["saves"] == 3 and report["last_step"] == 3


def test_the_first_copy_is_not_held_back_on_a_machine_just_booted(
    moto_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # time.monotonic() counts from the boot: a fresh CI machine was 408 s up when a mirror whose "last
    # copy" started at 0.0 held its first copy back for interval_s - 408 s (found by test_fencing's S3 test
    # on a machine up a few minutes). The mirror's clock reads as if the machine came up 5 s ago; only its
    # module sees that clock (asyncio's and boto's timers keep the real one).
    import time as real_time
    import types

    from safepoint.tiers import journal_mirror

    booted = real_time.monotonic() - 5.0
    clock = types.SimpleNamespace(monotonic=lambda: real_time.monotonic() - booted)
    monkeypatch.setattr(journal_mirror, "time", clock)
    monkeypatch.setattr(journal_mirror, "DEFAULT_INTERVAL_S", 3600.0)
    url, opts = f"s3://{bucket}/run", storage_options(moto_endpoint)
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(1, safepoint.TrainState(rng=False, extra={"n": 1}))
        deadline = real_time.monotonic() + 60
        while "run/.run/.journal.jsonl" not in _keys(moto_endpoint, bucket):
            assert real_time.monotonic() < deadline, "the first copy after step 1's commit never came"
            real_time.sleep(0.05)


def test_a_path_durable_root_with_a_local_root_gets_its_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # A network file system as the durable root and a local disk as local_root (the root is then a
    # file:// store): fsspec's local file system creates no parent directory for a small object, so
    # ROOT/.run/ was never made and every copy of the journal failed ("No such file or directory").
    durable = tmp_path / "durable"
    state = safepoint.TrainState(model=torch.nn.Linear(4, 4), rng=False)
    with caplog.at_level("WARNING", logger="safepoint"):
        with safepoint.CheckpointManager(durable, local_root=tmp_path / "local") as mgr:
            mgr.save(1, state)
            mgr.save(2, state)
    assert not [r for r in caplog.records if "run journal" in r.getMessage()]
    assert sorted(p.name for p in (durable / ".run").iterdir()) == [".attempts.json", ".journal.jsonl"]
    assert cli(["report", str(durable), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["attempts"] == 1 and report["saves"] == 2 and report["last_step"] == 2
