"""``safepoint diff``: per-key comparison of two checkpoint states (max abs difference, bitwise equality)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from safepoint.cli.tools_read import dtype_name


@dataclasses.dataclass(frozen=True, slots=True)
class DiffRow:
    key: str
    kind: str
    """'tensor', 'shape' (shapes differ), 'object' (non-tensor values), 'only_a' or 'only_b'."""
    max_abs: float | None = None
    identical: bool = False
    detail: str = ""


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if a.is_complex() or b.is_complex():
        dt = torch.complex128
    elif a.is_floating_point() or b.is_floating_point():
        dt = torch.float64  # wide enough for every float dtype, so the difference itself does not round
    else:
        dt = torch.int64
    return float((a.to(dt) - b.to(dt)).abs().max().item())


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def diff_states(a: dict[str, Any], b: dict[str, Any]) -> list[DiffRow]:
    fa, _ = flatten_state_dict(a)
    fb, _ = flatten_state_dict(b)
    rows = []
    for key in sorted(set(fa) | set(fb)):
        if key not in fb:
            rows.append(DiffRow(key, "only_a"))
        elif key not in fa:
            rows.append(DiffRow(key, "only_b"))
        else:
            rows.append(_diff_one(key, fa[key], fb[key]))
    return rows


def _diff_one(key: str, x: Any, y: Any) -> DiffRow:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.shape != y.shape:
            return DiffRow(key, "shape", detail=f"{tuple(x.shape)} vs {tuple(y.shape)}")
        note = f"{dtype_name(x.dtype)} vs {dtype_name(y.dtype)}" if x.dtype != y.dtype else ""
        return DiffRow(key, "tensor", max_abs_diff(x, y), _bitwise_equal(x, y), note)
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return DiffRow(key, "object", detail="tensor vs non-tensor")
    try:
        same = type(x) is type(y) and bool(x == y)
    except (TypeError, ValueError, RuntimeError):
        same = False
    return DiffRow(key, "object", identical=same, detail="" if same else f"{_short(x)} vs {_short(y)}")


def _short(v: Any, n: int = 40) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."
