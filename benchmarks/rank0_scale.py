"""A synthetic N-rank model of rank 0's commit and retention (issue 15, item 4), in one process.

    python benchmarks/rank0_scale.py OUT.json [--ranks 1000 10000] [--kept 50] [--dir D] [--no-rank-files]

For each N: a pending directory holding what N ranks write (one tiny ``__<r>_0.distcp`` and one
``rank-<r>.state`` per rank, and ``.metadata``), and the file lists rank 0 receives on DCP's write
collective. Timed on rank 0's side (median of ``--repeat``):

- ``commit_s``: ``SyncSaver._commit`` (check every listed file is visible, build the manifest, write and
  fsync it, rename into place), and the manifest's size;
- ``enqueue_s``: what retention costs the save now (``Retainer.committed``: queue the pass);
- ``pass_cold_s``: a retention pass of a manager that has not seen the root (reads all ``--kept``
  manifests, as every pass did before the index), with ``keep_last=kept`` and ``kept + 1`` committed;
- ``pass_warm_s``: a pass with the index warm (lists the root; the new step's info came with its commit);
  its decision only, nothing to delete;
- ``delete_s``: deleting one N-rank checkpoint (2N + 2 files). Both passes and the delete run on the
  deleter thread, off the save's path.

The ``--kept`` older steps hold only their manifest (a copy of the real one): retention reads manifests,
never data files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from safepoint.dist import Comm
from safepoint.policy.retainer import Retainer
from safepoint.policy.rules import Verdicts, build_retention
from safepoint.save.saver import SyncSaver
from safepoint.store.manifest import MANIFEST_NAME, Manifest
from safepoint.store.posix_layout import Layout

SECTIONS = ["model", "optimizer", "rng", "extra"]


RANK_FILES = True  # --no-rank-files: one file per rank, as before per-rank sections had their own files


def _pending(layout: Layout, step: int, ranks: int) -> tuple[Path, list[dict[str, tuple[int, str]]]]:
    pending = layout.new_pending(step, f"bench{step:08x}")
    pending.mkdir(parents=True)
    per_rank: list[dict[str, tuple[int, str]]] = []
    for r in range(ranks):
        files = {}
        written = [(f"__{r}_0.distcp", b"x" * 16), (f"rank-{r}.state", b"y" * 24)]
        for name, data in written if RANK_FILES else written[:1]:
            (pending / name).write_bytes(data)
            files[name] = (len(data), "00000000")
        per_rank.append(files)
    (pending / ".metadata").write_bytes(b"m" * 64)
    per_rank[0][".metadata"] = (64, "00000000")
    return pending, per_rank


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(base: Path, ranks: int, kept: int, repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {"ranks": ranks, "kept": kept}
    commits, enqueues, colds, warms, deletes = [], [], [], [], []
    for rep in range(repeat):
        root = base / f"n{ranks}-{rep}"
        layout = Layout(root)
        layout.ensure_root()
        saver = SyncSaver(layout, Comm(), build_retention(None, None, None, None, "min"))
        pending, per_rank = _pending(layout, kept + 1, ranks)
        args = (kept + 1, pending, "bench", per_rank, SECTIONS, {"loss": 1.0}, {}, {"write_s": 1.0})
        commits.append(_timed(lambda: saver._commit(*args)))  # noqa: B023
        manifest = (layout.step_path(kept + 1) / MANIFEST_NAME).read_bytes()
        out["manifest_bytes"] = len(manifest)
        parsed = Manifest.from_json(manifest)
        for step in range(1, kept + 1):  # older steps: their manifest only
            d = layout.step_path(step)
            d.mkdir()
            parsed.step = step
            (d / MANIFEST_NAME).write_bytes(parsed.to_json())
        info = layout.info(kept + 1, layout.read_manifest(kept + 1))
        retainer = Retainer(layout, build_retention(kept, None, None, None, "min"), Verdicts())
        # The pass's own work, on this thread (the deleter thread runs exactly this).
        retainer._index[kept + 1] = info
        colds.append(_timed(lambda: retainer._pass(kept + 1)))  # noqa: B023  reads kept manifests
        pending, per_rank = _pending(layout, kept + 2, ranks)
        args = (kept + 2, pending, "bench", per_rank, SECTIONS, {"loss": 1.0}, {}, {"write_s": 1.0})
        saver._commit(*args)
        info2 = layout.info(kept + 2, layout.read_manifest(kept + 2))
        # Each pass deletes the oldest step (kept + 2 committed, keep kept): make that one a full N-rank step
        # so the delete is measured at its real size.
        oldest = min(layout.committed_steps())
        shutil.rmtree(layout.step_path(oldest))
        shutil.copytree(layout.step_path(kept + 1), layout.step_path(oldest))
        retainer.committed(kept + 2, None)  # starts the thread (a failed save: no pass), as in a long run
        enqueues.append(_timed(lambda: retainer.committed(kept + 2, info2)))  # noqa: B023
        retainer.close()  # the queued pass ran on the thread (one delete); now time one on this thread
        # keep_last=kept + 1: the warm pass below decides but deletes nothing (the delete is timed apart).
        retainer = Retainer(layout, build_retention(kept + 1, None, None, None, "min"), Verdicts())
        retainer._pass(kept + 2)  # warm the index
        pending, per_rank = _pending(layout, kept + 3, ranks)
        saver._commit(kept + 3, pending, "bench", per_rank, SECTIONS, {}, {}, {})
        retainer._index[kept + 3] = layout.info(kept + 3, layout.read_manifest(kept + 3))
        before = layout.committed_steps()
        warms.append(_timed(lambda: retainer._pass(kept + 3)))  # noqa: B023  lists the root, no manifest read
        assert layout.committed_steps() == before
        victim = layout.step_path(kept + 2)
        deletes.append(_timed(lambda: layout.remove(kept + 2)))  # noqa: B023  a whole N-rank step
        assert not victim.exists()
        shutil.rmtree(root)
    for name, xs in (
        ("commit_s", commits),
        ("enqueue_s", enqueues),
        ("pass_cold_s", colds),
        ("pass_warm_s", warms),
        ("delete_s", deletes),
    ):
        out[name] = statistics.median(xs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--kept", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--no-rank-files", action="store_true")
    args = ap.parse_args()
    global RANK_FILES
    RANK_FILES = not args.no_rank_files
    base = Path(tempfile.mkdtemp(prefix="rank0-scale-", dir=args.dir))
    try:
        results = [measure(base, n, args.kept, args.repeat) for n in args.ranks]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    args.out.write_text(json.dumps(results, indent=1))
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
