"""Incremental saves and tiering (store/incremental.py, tiers/transfer.py): a stable group the durable
tier already holds is copied there server-side (S3 CopyObject), never uploaded again. On moto."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import safepoint
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.upload import MiB, TransferOptions
from safepoint.store.incremental import is_stable_group
from tests.helpers.s3 import FaultProxy, storage_options

CFG = TransferOptions(part_size=5 * MiB, concurrency=4)


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(2 * MiB // 4), requires_grad=False)  # 2 MiB, never changes
        self.adapter = nn.Parameter(torch.zeros(1000))


def test_an_unchanged_file_is_copied_server_side_not_uploaded(
    tmp_path: Path, proxy: FaultProxy, bucket: str
) -> None:
    url, opts = f"s3://{bucket}/run", storage_options(proxy.endpoint)
    model = Frozen()
    state = safepoint.TrainState(model=model)
    with safepoint.CheckpointManager(
        url, local_root=tmp_path / "l", storage_options=opts, transfer=CFG, keep=safepoint.Keep(last=5)
    ) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.adapter.add_(1.0)
            mgr.save(step, state)
            mgr.wait()
        proxy.body_bytes.clear()
        with torch.no_grad():
            model.adapter.add_(1.0)
        mgr.save(3, state)
        mgr.wait()
    layout = RemoteLayout(url, storage_options(proxy.endpoint), transfer=CFG)
    manifest = layout.read_manifest(3)
    stable = [n for n in manifest.files if is_stable_group(n)]
    assert stable and manifest.files[stable[0]].size > 2 * MiB
    sent = {path.rsplit("/", 1)[-1]: n for path, n in proxy.body_bytes.items() if "step-3" in path}
    assert sent.get(stable[0], 0) == 0, "the unchanged file was uploaded again"
    assert sum(sent.values()) < MiB, sent
    # The durable step is complete: it verifies and restores bit for bit.
    layout.verify(3)
    fresh = Frozen()
    with safepoint.CheckpointManager(url, storage_options=opts, transfer=CFG) as mgr:
        assert mgr.restore(safepoint.TrainState(model=fresh)) == 3
    assert torch.equal(fresh.base, model.base) and torch.equal(fresh.adapter, model.adapter)
