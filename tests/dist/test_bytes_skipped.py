"""``bytes_skipped`` on every rank: two real torchrun ranks (gloo), each linking frozen files of its own."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from safepoint.store.incremental import is_stable_group
from tests.conftest import PYTHON, REPO, SUBPROCESS_ENV


@pytest.mark.slow  # time bar of the default suite: two torchrun ranks; bytes_skipped is checked in-process by default (tests/goodput/test_events.py)
def test_every_rank_reports_the_bytes_every_rank_linked(tmp_path: Path) -> None:
    root, out = tmp_path / "root", tmp_path / "events"
    cmd = [
        PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(REPO / "tests" / "dist" / "skipped_worker.py"), str(root), str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = json.loads((root / "step-3" / "safepoint.json").read_text())["files"]
    # Step 3 linked each rank's stable group (written at step 2): rank 1's is twice rank 0's.
    linked = {name[2]: entry["size"] for name, entry in files.items() if is_stable_group(name)}
    assert set(linked) == {"0", "1"} and linked["1"] > linked["0"]
    for name in files:
        if is_stable_group(name):
            assert (root / "step-3" / name).stat().st_ino == (root / "step-2" / name).stat().st_ino
    for rank in (0, 1):
        events = json.loads(Path(f"{out}.{rank}").read_text())
        skipped = {(e["kind"], e["step"]): e["skipped"] for e in events}
        assert skipped[("save_written", 3)] == linked[str(rank)]  # this rank's own
        assert skipped[("save_committed", 3)] == linked["0"] + linked["1"]  # every rank's, on each rank
        assert skipped[("save_committed", 2)] == skipped[("save_committed", 1)] == 0
