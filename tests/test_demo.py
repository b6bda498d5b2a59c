"""The demo is the product's promise in one command; a short run must keep its verdict."""

from __future__ import annotations

from pathlib import Path

from safepoint import demo


def test_demo_short_run_is_bitwise_identical(tmp_path: Path) -> None:
    assert (
        demo.main(["--steps", "12", "--kill-at", "8", "--save-every", "3", "--out", str(tmp_path / "o")]) == 0
    )
    assert (tmp_path / "o" / "final.pt").exists()
