"""The variants of benchmarks/bench_save.py: each save and restore it times, in one place (disk or shm).

See bench_save.py's docstring for what each variant does and why they are compared.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
from _common import BenchState, Timing, remove, timed, tree_bytes
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import safepoint
from safepoint.dist import Comm
from safepoint.policy.rules import Retention
from safepoint.restore.restorer import Restorer
from safepoint.save.saver import SyncSaver
from safepoint.store.posix_layout import Layout

SAVE_VARIANTS = ("safepoint", "safepoint-writer", "dcp", "torch.save", "dd")
RESTORE_VARIANTS = ("safepoint", "safepoint-noverify", "verify", "dcp")
RESTORE_STEP = 1


class Location:
    """One place checkpoints go (disk or /dev/shm) and the managers writing there."""

    def __init__(self, name: str, base: Path, state: BenchState, threads: int) -> None:
        self.name = name
        self.base = base
        self.state = state
        self.threads = threads
        self.step = 1000
        base.mkdir(parents=True, exist_ok=True)
        self.mgr = safepoint.CheckpointManager(
            base / "safepoint", writer=safepoint.WriterOptions(threads=threads)
        )
        writer_layout = Layout(base / "safepoint-writer")
        writer_layout.ensure_root()
        self.writer = SyncSaver(writer_layout, Comm(), Retention(), writer_threads=threads)
        self.restore_root = base / "restore"
        self.restore_mgr: safepoint.CheckpointManager | None = None

    def save(self, variant: str) -> tuple[Timing, int]:
        """Run one save variant; return its timing and the bytes it wrote, then delete what it wrote."""
        self.step += 1
        step, plain, nbytes = self.step, self.state.plain, self.state.nbytes
        state = self.state.train_state()
        outs = {
            "safepoint": Path(self.mgr.layout.step_path(step)),
            "safepoint-writer": self.writer.layout.step_path(step),
            "dcp": self.base / f"dcp-{step}",
            "torch.save": self.base / f"torch-{step}.pt",
            "dd": self.base / f"dd-{step}.bin",
        }
        if variant not in outs:
            raise ValueError(f"unknown save variant {variant!r}")
        out = outs[variant]

        def run_dcp() -> None:
            writer = FileSystemWriter(
                out, single_file_per_rank=True, sync_files=True, thread_count=self.threads
            )
            dcp_save(plain, storage_writer=writer, no_dist=True)

        def run_torch_save() -> None:
            with open(out, "wb") as f:
                torch.save(plain, f)
                f.flush()
                os.fsync(f.fileno())

        dd = ["dd", "if=/dev/zero", f"of={out}", "bs=64M", f"count={nbytes}", "iflag=count_bytes"]
        run: dict[str, Callable[[], object]] = {
            "safepoint": lambda: self.mgr.save(step, state),
            "safepoint-writer": lambda: self.writer.write(step, plain, ["model", "optimizer"], {}, {}),
            "dcp": run_dcp,
            "torch.save": run_torch_save,
            "dd": lambda: subprocess.run([*dd, "conv=fdatasync", "status=none"], check=True),
        }
        timing = timed(run[variant])
        written = tree_bytes(out)
        remove(out)
        return timing, written

    # restore

    def prepare_restore(self) -> int:
        """One committed safepoint checkpoint (also a plain DCP directory) that every restore reads."""
        self.restore_mgr = safepoint.CheckpointManager(
            self.restore_root, writer=safepoint.WriterOptions(threads=self.threads)
        )
        info = self.restore_mgr.save(RESTORE_STEP, self.state.train_state())
        assert info is not None  # a sync manager returns what it committed
        return info.bytes

    def restore(self, variant: str) -> Timing:
        assert self.restore_mgr is not None
        mgr = self.restore_mgr
        step_dir = Path(mgr.layout.step_path(RESTORE_STEP))
        if variant == "safepoint":
            state = self.state.train_state()

            def run_restore() -> None:
                if mgr.restore(state) != RESTORE_STEP:
                    raise RuntimeError("safepoint restored the wrong step")

            return timed(run_restore)
        if variant == "safepoint-noverify":
            state = self.state.train_state()
            restorer = Restorer(mgr.layout, mgr.comm)
            return timed(lambda: restorer.load(mgr.layout.read_manifest(RESTORE_STEP), state))
        if variant == "verify":
            return timed(lambda: mgr.layout.verify(RESTORE_STEP))
        if variant == "dcp":
            return timed(
                lambda: dcp_load(self.state.plain, storage_reader=FileSystemReader(step_dir), no_dist=True)
            )
        raise ValueError(f"unknown restore variant {variant!r}")

    def close(self) -> None:
        self.mgr.close()
        if self.restore_mgr is not None:
            self.restore_mgr.close()
        shutil.rmtree(self.base, ignore_errors=True)
