"""A frozen tensor written once (a fine-tuning stage that unfreezes it for a step, a table refreshed now and
then) is grouped and linked again at the second save after the write, as on the first run: the save that
sees the write records its new fingerprint (store/incremental.py, save/staging.py), though the version
counter already says "written". Without it the tensor was written three times (the save of the write, the
next one unhashed, the one after into a new group) before it was linked again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import safepoint
from safepoint.store.incremental import is_stable_group
from safepoint.store.storage import read_metadata_file

WRITE_AT = 4  # the step whose save sees the frozen table written


def _file_of(step_dir: Path, fqn: str) -> Path:
    md = read_metadata_file(step_dir / ".metadata")
    names = {info.relative_path for idx, info in md.storage_data.items() if idx.fqn == fqn}
    assert len(names) == 1
    return step_dir / names.pop()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_frozen_tensor_written_once_is_linked_again_two_saves_later(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 8))
    table = model[0].weight
    table.requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    state = safepoint.TrainState(model=model, optimizer=opt)
    root = tmp_path / "root"
    writer = safepoint.WriterOptions(async_writer="thread", if_busy="wait")
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with safepoint.CheckpointManager(
        root, keep=safepoint.Keep(last=8), async_save=mode == "async", writer=writer
    ) as mgr:
        for step in range(1, 8):
            model(torch.randint(0, 256, (4,))).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == WRITE_AT:
                version = table._version
                with torch.no_grad():
                    table.mul_(0.5)  # an in-place write: the version counter moves
                assert table._version != version
            mgr.save(step, state)
            mgr.wait()
            expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
    files = {step: _file_of(root / f"step-{step}", "model.0.weight") for step in range(1, 8)}
    # Before the write: grouped at step 2, linked at 3; the save of the write writes it with the changes.
    assert files[3].stat().st_ino == files[2].stat().st_ino
    assert not is_stable_group(files[WRITE_AT].name)
    # The next save proves it unchanged against the fingerprint recorded at the write and groups it; the one
    # after links that group (without the recorded fingerprint it was written again, unhashed, at step 5,
    # and only grouped at 6).
    assert is_stable_group(files[WRITE_AT + 1].name)
    assert files[WRITE_AT + 2].stat().st_ino == files[WRITE_AT + 1].stat().st_ino
    assert files[WRITE_AT + 3].stat().st_ino == files[WRITE_AT + 1].stat().st_ino
    # Every step holds its own bytes, read by plain DCP.
    for step, sd in expected.items():
        loaded = {"model": {k: torch.zeros_like(v) for k, v in sd.items()}}
        dcp.load(loaded, checkpoint_id=str(root / f"step-{step}"))
        for k, v in sd.items():
            assert torch.equal(loaded["model"][k], v), (step, k)
