"""Fixtures shared by the hostile-root tests of this folder."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside ROOT with files that must survive anything done to ROOT."""
    d = tmp_path / "outside"
    (d / "sub").mkdir(parents=True)
    (d / "precious.txt").write_text("keep me")
    (d / "sub" / "also.txt").write_text("keep me too")
    return d
