"""Restoring from an object store holds a bounded amount in memory, whatever it skips: the gap between two
loaded items (a whole ignored section) is checksummed in pieces, like the local reader's, never read into
one buffer; and the object is read ahead by at most one such piece. Real s3fs against a moto server, run
in a process of its own so that tracemalloc here counts the client's memory only (moto copies a whole
object for every ranged GET)."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import safepoint
import safepoint.remote.io as remote_io
from safepoint.dist import Comm
from safepoint.remote.object_layout import RemoteLayout
from safepoint.restore.partial import Selection
from safepoint.restore.restorer import Restorer
from tests.conftest import SUBPROCESS_ENV
from tests.helpers.s3 import free_port, new_bucket, storage_options

MiB = 1024 * 1024


@pytest.fixture
def moto_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, env=SUBPROCESS_ENV, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # werkzeug says when it listens
            if "Running on" in line:
                break
        else:
            pytest.fail(f"moto server exited with {proc.wait()}")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(16)])  # 4 MiB of weights
    opt = torch.optim.Adam(model.parameters())  # 8 MiB of state: one 8 MiB gap when ignored
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    return model, opt


def test_an_ignored_section_is_checksummed_in_bounded_pieces(
    moto_process: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts = f"s3://{new_bucket(moto_process)}/run", storage_options(moto_process)
    model, opt = _trained()
    with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(1, safepoint.TrainState(model=model, optimizer=opt, rng=False))
    monkeypatch.setattr(remote_io, "READ_PIECE", 256 * 1024)
    model2, opt2 = _trained()
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    state = safepoint.TrainState(model=model2, optimizer=opt2, rng=False)
    restorer = Restorer(RemoteLayout(url, opts), Comm())
    restorer.selection = Selection(ignore=("optimizer",))
    manifest = restorer.choose(None)  # verified first (the store's own checksums): not measured here
    assert manifest is not None
    tracemalloc.start()  # Python allocations only (bytes read, s3fs's cache, moto's replies): not tensors
    try:
        restorer.load(manifest, state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), model.parameters(), strict=True))
    # Each weight is 256 KiB; the skipped optimizer state is 8 MiB, read in one piece before.
    assert peak < 4 * MiB, f"peak {peak / MiB:.1f} MiB"
