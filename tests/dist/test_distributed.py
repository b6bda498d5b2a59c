"""Distributed exactness under real torchrun processes (gloo, CPU).

Each launch costs seconds, so cases are batched: one 2-rank launch runs every job of ``_two_rank_jobs``
and survives three real failures, one per torchrun attempt (``--max-restarts=3``):

    attempt 0: rank 1 SIGKILLs itself after step 7 (DDP)           -> attempt 1 resumes from 6, exactly
    attempt 1: rank 1 is SIGKILLed opening its shard of step 9     -> attempt 2: 9 never committed,
               (FSDP2)                                                resumes from 6, exactly
    attempt 2: rank 1 blocks opening its shard of step 6 (FSDP1)   -> rank 0 fails after the 3 s timeout;
                                                                      attempt 3 resumes from 3, exactly

The restarts also exercise safepoint.init_process_group: without a per-attempt store namespace most
restarted attempts fail to connect gloo (docs/elastic.md). Three more launches continue one FSDP2 run
with ResumableSampler at world sizes 3, 1 and 2 (resharding).
"""

from __future__ import annotations

import datetime
import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

import safepoint
from safepoint.data import rng
from safepoint.store.posix_layout import Layout
from tests.conftest import REPO
from tests.helpers.launch import assert_bitwise, events, finish, load, start

WORKER = REPO / "tests" / "dist" / "worker.py"
STEPS, EVERY = 12, 3
HANG_TIMEOUT_S = 3.0

pytestmark = pytest.mark.timeout(400)


def torchrun(out: Path, nproc: int, jobs: list[dict[str, Any]], max_restarts: int = 0) -> None:
    tag = f"plan-{nproc}-{len(list(out.glob('plan-*.json')))}"
    t0 = time.monotonic()
    proc = start(WORKER, out, tag, jobs, nproc=nproc, max_restarts=max_restarts)
    rc, output = finish(out, tag, proc)
    assert rc == 0, f"torchrun failed after {time.monotonic() - t0:.1f}s:\n{output[-6000:]}"


def _train(name: str, model: str, root: Path, **kw: Any) -> dict[str, Any]:
    return {"name": name, "model": model, "root": str(root), "steps": STEPS, "save_every": EVERY, **kw}


def _two_rank_jobs(tmp: Path) -> list[dict[str, Any]]:
    jobs = [_train(f"ref-{m}", m, tmp / f"ref-{m}", reload=True) for m in ("ddp", "fsdp2", "fsdp1")]
    # Retention on rank 0's deleter thread (the default) while both ranks go on saving.
    jobs.append(_train("ref-plain", "plain", tmp / "ref-plain", reload=True, keep_last=1))
    # The same FSDP2 run with async saves written by a writer process per rank (DTensor shards in shared
    # memory): the checkpoints must restore to exactly the state the synchronous run saved.
    jobs.append(
        _train(
            "process-fsdp2", "fsdp2", tmp / "process-fsdp2", reload=True, async_writer="process", keep_last=2
        )
    )
    jobs += [
        {"name": "rng", "kind": "rng", "root": str(tmp / "rng")},
        {"name": "nodelocal", "kind": "nodelocal", "root": str(tmp / "nodelocal")},
        {"name": "fallback", "kind": "fallback", "root": str(tmp / "fallback")},
        {
            "name": "agreement",
            "kind": "agreement",
            "steps": 300,
            "step_sleep_s": 0.001,
            "target_s": 0.05,
            "raise_at": [37, 150],
        },
        {
            "name": "timed",
            "model": "ddp",
            "root": str(tmp / "timed"),
            "steps": 20,
            "save_every_s": 0.2,
            "step_sleep_s": 0.01,
            "rank0_extra_s": 0.04,
            "timeout_s": 10.0,
        },
        {**_reshard_phase(tmp, 1), "dump_restored": False},
        _train("kill-ddp", "ddp", tmp / "kill-ddp", kill={"attempt": 0, "rank": 1, "step": 7}),
        _train(
            "midsave-fsdp2",
            "fsdp2",
            tmp / "midsave-fsdp2",
            fault={"attempt": 1, "rank": 1, "step": 9, "action": "kill"},
        ),
        _train(
            "hang-fsdp1",
            "fsdp1",
            tmp / "hang-fsdp1",
            fault={"attempt": 2, "rank": 1, "step": 6, "action": "hang"},
            timeout_s=HANG_TIMEOUT_S,
        ),
    ]
    return jobs


RESHARD = [(1, 2, 3), (2, 3, 6), (3, 1, 9), (4, 2, 18)]  # (phase, world size, steps at its end)
SAMPLES = 60  # one epoch: 12 + 18 + 6 + 24 samples in phases 1-4, then 3 steps into the next epoch


def _reshard_phase(tmp: Path, phase: int) -> dict[str, Any]:
    steps = RESHARD[phase - 1][2]
    return {
        "name": f"reshard-p{phase}",
        "model": "fsdp2",
        "root": str(tmp / "reshard"),
        "steps": steps,
        "save_every": 3,
        "samples": SAMPLES,
        "dump_restored": True,
        "log_rng": True,
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("dist2")
    torchrun(out, 2, _two_rank_jobs(out), max_restarts=3)
    yield out


@pytest.fixture(scope="module")
def resharded(two_ranks: Path) -> Path:
    for phase, ws, _ in RESHARD[1:]:
        torchrun(two_ranks, ws, [_reshard_phase(two_ranks, phase)])
    return two_ranks


# ---- exact resume ----------------------------------------------------------------------------------------


def _resumes(out: Path, job: str) -> list[tuple[int, int, list[int]]]:
    """(attempt, restored step, committed steps seen before restoring) for every start of ``job``."""
    starts = [(e["attempt"], e["step"], e["committed"]) for e in events(out, job, "restored", rank=0)]
    for r in (0, 1):  # every rank restored the same step each time
        assert [e["step"] for e in events(out, job, "restored", rank=r)] == [st[1] for st in starts]
    return starts


def test_sigkill_mid_training_then_torchrun_restart_resumes_exactly(two_ranks: Path) -> None:
    # Attempt 0: rank 1 SIGKILLed itself after step 7; attempt 1 resumed from step 6 (DDP).
    assert _resumes(two_ranks, "kill-ddp") == [(0, 0, []), (1, 6, [3, 6])]
    assert_bitwise(load(two_ranks / "kill-ddp.final.pt"), load(two_ranks / "ref-ddp.final.pt"), "ddp")


def test_rank_killed_mid_save_commits_nothing_and_restart_resumes_exactly(two_ranks: Path) -> None:
    # Attempt 1: rank 1 SIGKILLed while opening its shard of step 9 (FSDP2): attempt 2 finds 3 and 6 only.
    assert _resumes(two_ranks, "midsave-fsdp2") == [(1, 0, []), (2, 6, [3, 6])]
    assert_bitwise(
        load(two_ranks / "midsave-fsdp2.final.pt"), load(two_ranks / "ref-fsdp2.final.pt"), "fsdp2"
    )


def test_hung_rank_mid_save_fails_within_timeout_and_restart_resumes(two_ranks: Path) -> None:
    # Attempt 2: rank 1 blocks while opening its shard of step 6 (FSDP1); rank 0 must give up.
    failed = events(two_ranks, "hang-fsdp1", "save_failed")
    assert [(e["rank"], e["attempt"], e["step"], e["error"]) for e in failed] == [
        (0, 2, 6, "PeerTimeoutError")
    ], failed
    # gloo enforces the group's timeout inside DCP's own collectives: no waiting beyond it.
    assert HANG_TIMEOUT_S * 0.9 <= failed[0]["elapsed"] < HANG_TIMEOUT_S * 2 + 2, failed[0]
    assert "collective timeout of 3s" in failed[0]["msg"] and "Timed out" in failed[0]["msg"]
    assert "not committed" in failed[0]["msg"]
    assert _resumes(two_ranks, "hang-fsdp1") == [(2, 0, []), (3, 3, [3])]
    assert_bitwise(load(two_ranks / "hang-fsdp1.final.pt"), load(two_ranks / "ref-fsdp1.final.pt"), "fsdp1")


@pytest.mark.parametrize("model", ["ddp", "fsdp2", "fsdp1", "plain"])
def test_every_model_kind_saves_and_restores(two_ranks: Path, model: str) -> None:
    job = f"ref-{model}"
    saves = events(two_ranks, job, "saves")
    assert sorted(e["rank"] for e in saves) == [0, 1]
    assert all(e["steps"] == [3, 6, 9, 12] for e in saves), saves
    assert [(e["step"], e["scheduler"]) for e in events(two_ranks, job, "reloaded")] == [(12, 12)] * 2
    # One manifest, committed once, lists every rank's own file with the checksum that rank computed.
    manifest = Layout(two_ranks / job).verify(12)
    assert manifest.world_size == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest.files), manifest.files
    assert_bitwise(load(two_ranks / f"{job}.reloaded.pt"), load(two_ranks / f"{job}.final.pt"), job)
    # ref-plain: keep_last=1, deleted on rank 0's deleter thread, drained by close(); nothing left over.
    assert Layout(two_ranks / job).committed_steps() == ([12] if model == "plain" else [3, 6, 9, 12])
    assert not list((two_ranks / job / ".pending").iterdir())


def test_process_writer_saves_each_ranks_shard_exactly(two_ranks: Path) -> None:
    saves = events(two_ranks, "process-fsdp2", "saves")
    assert sorted(e["rank"] for e in saves) == [0, 1]
    assert all(e["steps"] == [3, 6, 9, 12] for e in saves), saves
    assert Layout(two_ranks / "process-fsdp2").committed_steps() == [9, 12]  # keep_last=2, the deleter
    # Each rank's process wrote all four; the plan and the DTensor shards' places went over once.
    assert all(e["writes"] == 4 and e["descriptions"] == 1 for e in saves), saves
    manifest = Layout(two_ranks / "process-fsdp2").verify(12)
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest.files), manifest.files
    final = load(two_ranks / "process-fsdp2.final.pt")
    assert_bitwise(final, load(two_ranks / "ref-fsdp2.final.pt"), "process-fsdp2 vs sync")
    assert_bitwise(load(two_ranks / "process-fsdp2.reloaded.pt"), final, "process-fsdp2 reloaded")


# ---- per-rank state, node-local roots, agreement ---------------------------------------------------------


def test_rank_local_state_is_restored_per_rank(two_ranks: Path) -> None:
    recs = {e["rank"]: e for e in events(two_ranks, "rng", "rng")}
    assert sorted(recs) == [0, 1]
    for r, e in recs.items():
        assert e["got"] == e["expected"], f"rank {r} did not get its own RNG back"
        assert e["position"] == 100 + r and e["marker"] == f"rank{r}"
    assert recs[0]["expected"] != recs[1]["expected"]  # the streams really differ


def test_node_local_root_is_refused_with_a_clear_error(two_ranks: Path) -> None:
    failed = events(two_ranks, "nodelocal", "save_failed")
    assert sorted(e["rank"] for e in failed) == [0, 1]
    assert all("node-local" in e["msg"] for e in failed), failed
    assert not list((two_ranks / "nodelocal" / "node0").glob("step-*"))
    refused = events(two_ranks, "nodelocal", "restore_failed")
    assert sorted(e["rank"] for e in refused) == [0, 1], refused
    assert all(e["error"] == "CheckpointError" and "node-local" in e["msg"] for e in refused), refused


def test_a_bad_file_in_one_ranks_share_makes_every_rank_fall_back(two_ranks: Path) -> None:
    recs = {e["rank"]: e for e in events(two_ranks, "fallback", "restored")}
    assert sorted(recs) == [0, 1] and recs[0]["step"] == recs[1]["step"] == 3, recs
    victim = recs[0]["victim"]
    # Rank 0 warns once, naming the file and the rank whose share of the verification found it.
    assert any(victim in w and "found by rank 1" in w for w in recs[0]["warnings"]), recs[0]["warnings"]


def test_ranks_agree_on_a_flag_raised_on_one_rank(two_ranks: Path) -> None:
    recs = {e["rank"]: e for e in events(two_ranks, "agreement", "agreed")}
    assert recs[0]["agreed"] == recs[1]["agreed"] and recs[0]["checks"] == recs[1]["checks"]
    agreed = recs[0]["agreed"]
    assert len(agreed) == 2 and 37 <= agreed[0] < 150 <= agreed[1], agreed
    assert agreed[0] - 37 <= 80 and agreed[1] - 150 <= 80, "acted on too late"
    assert recs[0]["checks"] < 300 / 3, "ranks talked on (almost) every step"


def test_time_based_saves_happen_on_every_rank_or_none(two_ranks: Path) -> None:
    saves = {e["rank"]: e["steps"] for e in events(two_ranks, "timed", "saves")}
    assert saves[0] == saves[1] and saves[0], saves


# ---- resharding ------------------------------------------------------------------------------------------


@pytest.mark.slow  # resharding also runs by default in test_examples (2 -> 3) and test_sections (2 -> 1)
def test_reshard_2_3_1_2_exact_state_and_every_sample_once(resharded: Path) -> None:
    out = resharded
    for (phase, ws, _), (_, _, prev_steps) in zip(RESHARD[1:], RESHARD[:-1], strict=True):
        name = f"reshard-p{phase}"
        starts = events(out, name, "restored")
        assert len(starts) == ws and {e["step"] for e in starts} == {prev_steps}, starts
        # Model and optimizer, resharded by DCP, equal the full state the previous world size saved.
        assert_bitwise(load(out / f"{name}.restored.pt"), load(out / f"reshard-p{phase - 1}.final.pt"), name)
    final = load(out / "reshard-p4.final.pt")
    restored = load(out / "reshard-p4.restored.pt")
    assert not torch.equal(final["model"]["net.0.weight"], restored["model"]["net.0.weight"])  # trained on

    by_step: dict[int, list[int]] = defaultdict(list)
    for phase, _, _ in RESHARD:
        for e in events(out, f"reshard-p{phase}", "batch"):
            by_step[e["step"]].extend(e["indices"])
    assert sorted(by_step) == list(range(1, 19))
    epoch0 = [i for s in range(1, 16) for i in by_step[s]]
    assert Counter(epoch0) == Counter(range(SAMPLES)), "a sample was skipped or seen twice in the epoch"
    epoch1 = [i for s in range(16, 19) for i in by_step[s]]
    assert len(epoch1) == len(set(epoch1)) == 12


@pytest.mark.slow  # time bar of the default suite: three more torchrun phases; resharding runs by default in test_examples (fsdp2 at another world size)
def test_rng_of_surviving_and_new_ranks_after_reshard(resharded: Path) -> None:
    out = resharded
    for (phase, ws, _), (_, old_ws, step) in zip(RESHARD[1:], RESHARD[:-1], strict=True):
        ends = {e["rank"]: e["draw"] for e in events(out, f"reshard-p{phase - 1}", "rng_end")}
        starts = {e["rank"]: e["draw"] for e in events(out, f"reshard-p{phase}", "rng_start")}
        for r in range(ws):
            if r < old_ws:
                assert starts[r] == ends[r], f"phase {phase}: rank {r} did not get its own RNG back"
            else:
                assert starts[r] == _derived_draw(out / "reshard" / f"step-{step}", r), f"phase {phase}"


def _derived_draw(path: Path, rank: int) -> list[float]:
    """What the documented rule gives a rank that did not exist at save time: seed_all(derived_seed)."""
    # Saved rank 0's RNG, from its rank file (store/rank_state.py: per-rank sections are not in .metadata).
    saved = torch.load(path / "rank-0.state", weights_only=True)
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        rng.seed_all(rng.derived_seed(saved["rng"], rank))
        draw: list[float] = torch.rand(3).tolist()
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
    return draw


# ---- the restart-safe process group ----------------------------------------------------------------------


def test_init_process_group_keys_the_store_by_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun's shared agent store, the default group's keys live under the attempt's prefix."""
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "RANK": "0", "WORLD_SIZE": "1"}
    env |= {
        "LOCAL_WORLD_SIZE": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "3",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    safepoint.init_process_group("gloo", timeout_s=10)
    try:
        assert server.check(["safepoint/attempt_3/0//cpu//0/0"])  # gloo's address of rank 0, attempt 3
        assert not server.check(["default_pg/0//cpu//0/0"]) and not server.check(["0//cpu//0/0"])
    finally:
        dist.destroy_process_group()
