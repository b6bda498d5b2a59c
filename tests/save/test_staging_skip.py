"""Async staging skips what did not change (save/staging.py): a tensor proven unchanged since its buffer got
its bytes is not copied again; a write the version counter misses is still copied; a tied weight has one
buffer, is copied once, and an async save writes it once and both keys load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import safepoint
from safepoint.cli.main import main
from safepoint.save import staging
from safepoint.save.staging import Stager
from safepoint.store.storage import read_metadata_file


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    tied = torch.randn(128, 64)  # 32 KiB: over FINGERPRINT_CPU_MIN_BYTES, proven unchanged at staging
    return {
        "frozen": torch.randn(8192),
        "trained": torch.randn(200),
        "emb": tied,
        "head": tied,  # tied: two keys, one tensor
        "step": torch.tensor(3.0),
        "nested": {"t": torch.randn(7, 5).t(), "n": 4},  # non-contiguous
        "seq": [torch.randn(3)],
    }


def _equal(snapshot: dict[str, object], sd: dict[str, object]) -> None:
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(snapshot[k], v), k  # type: ignore[arg-type]
    assert torch.equal(snapshot["nested"]["t"], sd["nested"]["t"])  # type: ignore[index]
    assert snapshot["nested"]["n"] == 4  # type: ignore[index]


@pytest.mark.parametrize("shared", [False, True], ids=["thread", "process"])
def test_unchanged_tensors_are_not_copied_again(shared: bool) -> None:
    if shared and not hasattr(os, "memfd_create"):
        pytest.skip("shared staging is Linux-only")
    sd = _state()
    frozen, trained, tied = sd["frozen"], sd["trained"], sd["emb"]
    assert isinstance(frozen, torch.Tensor) and isinstance(trained, torch.Tensor)
    assert isinstance(tied, torch.Tensor)
    stager = Stager(shared=shared)
    first = stager.stage(sd)
    _equal(first, sd)
    assert first["emb"] is first["head"]  # one buffer for the tied weight
    assert stager.skipped == 0
    with torch.no_grad():
        trained.add_(1.0)  # an optimizer step: the version counter moves
    second = stager.stage(sd)
    _equal(second, sd)
    assert stager.allocations == 1
    # Not copied: everything but the trained tensor (the frozen one, the tied one once, the rest).
    unchanged = frozen.nbytes + tied.nbytes
    assert stager.skipped == unchanged  # the small tensors are copied (test_small_cpu_tensors_...)
    # The trained one was copied without a fingerprint (its counter moved): the writer writes it unhashed.
    assert list(stager.fingerprints.values()).count(None) == 1
    # Writes the version counter misses: still copied (the fingerprint decides, never the counter).
    version = frozen._version
    frozen.data[5] += 1.0
    frozen.numpy()[7] = 42.0
    tied.data[0, 0] = -1.0
    assert frozen._version == version
    third = stager.stage(sd)
    _equal(third, sd)
    assert stager.skipped < 1024
    # The staged fingerprints are those of the staged bytes: the writer uses them (store/incremental.py).
    assert len(stager.fingerprints) == 2 and None not in stager.fingerprints.values()  # frozen, tied


def test_untying_reallocates_the_buffers() -> None:
    sd = _state()
    stager = Stager()
    stager.stage(sd)
    sd["head"] = sd["head"].clone()  # type: ignore[attr-defined]
    sd["head"].add_(1.0)  # type: ignore[attr-defined]
    snapshot = stager.stage(sd)
    assert stager.allocations == 2 and snapshot["emb"] is not snapshot["head"]
    _equal(snapshot, sd)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.emb.weight.requires_grad_(False)
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 256, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("async_writer", ["thread", "process"])
def test_an_async_save_writes_a_tied_weight_once_and_both_keys_load(root: Path, async_writer: str) -> None:
    if async_writer == "process" and not hasattr(os, "memfd_create"):
        pytest.skip("the process writer is Linux-only")
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.mid.parameters())
    state = safepoint.TrainState(model=model, optimizer=opt)
    with safepoint.CheckpointManager(
        root, async_save=True, writer=safepoint.WriterOptions(async_writer=async_writer)
    ) as mgr:
        for step in (1, 2, 3):
            model.mid(torch.randn(2, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, state)
            mgr.wait()
    for step in (1, 3):
        md = read_metadata_file(root / f"step-{step}" / ".metadata")
        where = {idx.fqn: info for idx, info in md.storage_data.items()}
        emb, head = where["model.emb.weight"], where["model.head.weight"]
        assert (emb.relative_path, emb.offset, emb.length) == (head.relative_path, head.offset, head.length)
        manifest = json.loads((root / f"step-{step}" / "safepoint.json").read_text())
        assert manifest["extra"]["incremental"]["aliased"] == 1
    assert main(["verify", str(root), "--all"]) == 0
    sd = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(sd, checkpoint_id=str(root / "step-3"))
    assert torch.equal(sd["model"]["head.weight"], model.emb.weight)
    assert torch.equal(sd["model"]["emb.weight"], model.emb.weight)
    torch.manual_seed(5)
    fresh = Tied()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == 3
    assert torch.equal(fresh.emb.weight, model.emb.weight) and fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh.mid.weight, model.mid.weight)


def test_small_cpu_tensors_are_copied_not_fingerprinted_at_staging(stager: Stager) -> None:
    # Adam's 0-d step counters of a frozen layer, a small bias: cheaper to copy than to fingerprint inside
    # the loop's blocking time (FINGERPRINT_CPU_MIN_BYTES); the large frozen tensor is still proven and
    # skipped. A write the version counter misses reaches the snapshot either way.
    big = torch.randn(64, 128)  # 32 KiB
    small = {"step": torch.tensor(7.0), "bias": torch.randn(100), "trained": torch.randn(50)}
    sd: dict[str, object] = {"big": big, **small}
    assert big.nbytes >= staging.FINGERPRINT_CPU_MIN_BYTES > small["bias"].nbytes
    stager.stage(sd)
    with torch.no_grad():
        small["trained"].add_(1.0)
    snapshot = stager.stage(sd)
    assert all(torch.equal(snapshot[k], v) for k, v in sd.items())  # type: ignore[arg-type]
    assert stager.skipped == big.nbytes  # only the large one proven unchanged, not copied
    # Only the large one fingerprinted; the moved one marked unhashed; the small unchanged ones left to the
    # writer, which fingerprints their staged copies (off the loop).
    assert len(stager.fingerprints) == 2 and list(stager.fingerprints.values()).count(None) == 1
    small["step"].numpy()[()] = 8.0  # a write the version counter misses
    small["bias"].data[3] = 42.0
    snapshot = stager.stage(sd)
    for k, v in sd.items():
        assert torch.equal(snapshot[k], v), k  # type: ignore[arg-type]
    assert stager.skipped == big.nbytes


def test_a_state_of_small_tensors_only_is_copied_whole_and_only_the_moved_ones_marked_unhashed(
    stager: Stager,
) -> None:
    # Every tensor under FINGERPRINT_CPU_MIN_BYTES (a frozen part made of small tensors): all copied at
    # every save, whatever their counters say (one batched copy of the plan's lists, no index picking);
    # only those whose counter moved are marked written-unhashed, the rest left to the writer to hash.
    torch.manual_seed(0)
    tied = torch.randn(20)
    sd: dict[str, object] = {
        "a": torch.randn(100), "b": torch.randn(4, 6).t(), "step": torch.tensor(2.0),
        "emb": tied, "head": tied, "groups": [{"m": torch.randn(30), "lr": 0.1}],
    }  # fmt: skip
    a, b, step = sd["a"], sd["b"], sd["step"]
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(step, torch.Tensor)
    stager.stage(sd)
    for _ in range(2):
        with torch.no_grad():
            a.add_(1.0)  # the counter moves
            step.add_(1.0)
        b.numpy()[1, 2] = 7.0  # a write the counter misses
        tied.numpy()[3] += 1.0
        snapshot = stager.stage(sd)
        assert stager.allocations == 1 and stager.skipped == 0
        for k in ("a", "b", "step", "emb", "head"):
            assert torch.equal(snapshot[k], sd[k]), k  # type: ignore[arg-type]
        assert snapshot["emb"] is snapshot["head"]
        assert torch.equal(snapshot["groups"][0]["m"], sd["groups"][0]["m"])  # type: ignore[index]
        # Exactly the two moved ones, unhashed: b, the tie and m are hashed by the writer from the copy.
        assert len(stager.fingerprints) == 2 and set(stager.fingerprints.values()) == {None}


class SmallFrozen(nn.Module):
    """A frozen part made only of small tensors (each under FINGERPRINT_CPU_MIN_BYTES) and a trained one."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.register_buffer("table", torch.randn(1000))
        self.trained = nn.Linear(8, 8)


@pytest.mark.parametrize("gathered", [False, True], ids=["per-tensor", "gathered"])
def test_an_async_save_still_links_small_unchanged_tensors(
    root: Path, gathered: bool, request: pytest.FixtureRequest
) -> None:
    # Staging copied them without a fingerprint: the writer fingerprints the staged copies and links them
    # from the previous checkpoint when unchanged, as when staging fingerprinted them (step 2 puts them in
    # a stable group, step 3 links it: the same figures as main's); every key restores bit for bit. The
    # same when they reach their buffers through save/gather.py's chunks.
    if gathered:
        request.getfixturevalue("gather_on_cpu")
    torch.manual_seed(0)
    model = SmallFrozen()
    opt = torch.optim.Adam(model.trained.parameters())
    state = safepoint.TrainState(model=model, optimizer=opt, rng=False)
    frozen = sum(int(t.nbytes) for t in model.frozen.state_dict().values()) + 1000 * 4  # and the table
    assert all(int(t.nbytes) < staging.FINGERPRINT_CPU_MIN_BYTES for t in model.state_dict().values())
    with safepoint.CheckpointManager(
        root, async_save=True, writer=safepoint.WriterOptions(async_writer="thread")
    ) as mgr:
        for step in (1, 2, 3):
            model.trained(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, state)
            assert mgr._stager.gathered == (5 + 6 if gathered else 0)  # the model's 5, Adam's 2 x 3
            mgr.wait()
    stats = json.loads((root / "step-3" / "safepoint.json").read_text())["extra"]["incremental"]
    assert stats["linked"] >= frozen, stats
    torch.manual_seed(1)
    fresh = SmallFrozen()
    with safepoint.CheckpointManager(root) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == 3
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
