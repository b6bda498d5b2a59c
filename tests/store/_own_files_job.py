"""The child processes of tests/store/test_own_files.py (forked from the fork server, see
tests/helpers/example_runs.py ``run_job``): what could hang on a FIFO runs here, under the test's timeout.

``open ROOT auto|-``: open a CheckpointManager on ROOT (``auto``: ``save_every_seconds="auto"``, which reads
``.attempts.json``) and print what it restored, or the LeaseError's one line.
``uploads ROOT``: print ``UploadHistory(ROOT).seconds`` (it reads ``.uploads.json``)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

import safepoint
from safepoint.policy.history import UploadHistory


def _open(root: str, auto: bool) -> None:
    warnings.simplefilter("ignore")
    try:
        mgr = (
            safepoint.CheckpointManager(root, save_every_seconds="auto")
            if auto
            else safepoint.CheckpointManager(root)
        )
        with mgr as m:
            print("restored", m.restore(safepoint.TrainState(model=torch.nn.Linear(2, 2))))
    except safepoint.LeaseError as e:
        print("refused:", e)


if __name__ == "__main__":
    if sys.argv[1] == "open":
        _open(sys.argv[2], sys.argv[3] == "auto")
    else:
        print(UploadHistory(Path(sys.argv[2])).seconds)
