"""What a committed step stores, item by item, read straight from its ``.distcp`` files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader


def stored(step_dir: Path) -> dict[str, Any]:
    """Every item of a committed step as its bytes load (``weights_only``, under the caller's allowlist):
    the item types and attributes a save wrote, not what restore makes of them in a template."""
    md = FileSystemReader(str(step_dir)).read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        with open(step_dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        out[index.fqn] = torch.load(io.BytesIO(raw), weights_only=True)
    return out
