"""``safepoint diff``: per-key comparison of two checkpoint states (max abs difference, bitwise equality),
and which two checkpoints the command's arguments name (two steps of one root, or one of each of two
roots: a resumed run against a reference)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from safepoint.cli import tools
from safepoint.cli.tools_read import dtype_name
from safepoint.errors import CheckpointError
from safepoint.store.guard import parse_step
from safepoint.store.posix_layout import Layout

# ASCII digits only: str.isdigit() and \d also accept other scripts' digits (Arabic-Indic...),
# and int() reads them.
_NUMBER = re.compile(r"[0-9]+")
USAGE = "diff ROOT A B, diff ROOT_A ROOT_B [--step N] or diff PATH_A/step-N PATH_B/step-M"


@dataclasses.dataclass(frozen=True, slots=True)
class Side:
    """One checkpoint to compare: its root, its step, and how the output names it."""

    layout: Layout
    step: int
    label: str


def shape_error(paths: list[str]) -> str | None:
    """Why ``paths`` (the command's positional arguments) fit none of the forms, or None."""
    if len(paths) == 3:
        if not all(_NUMBER.fullmatch(p) for p in paths[1:]):
            return f"with three arguments, A and B are step numbers ({USAGE})"
        return None
    if len(paths) == 2:
        if _NUMBER.fullmatch(paths[1]):
            return f"two steps to compare, or two roots ({USAGE}); a root named {paths[1]}: ./{paths[1]}"
        return None
    return f"takes two or three arguments ({USAGE})"


def resolve_sides(paths: list[str], step: int | None) -> tuple[Side, Side]:
    """The two checkpoints ``paths`` name (see ``USAGE``): a step path (a directory named ``step-N``) is
    that checkpoint; a root is its step ``step``, or else the newest step both roots hold."""
    if len(paths) == 3:
        if step is not None:
            raise CheckpointError(f"--step goes with two roots ({USAGE})")
        layout = tools.open_root(paths[0])
        a, b = (tools.resolve_step(layout, int(p)) for p in paths[1:])
        return Side(layout, a, f"step {a}"), Side(layout, b, f"step {b}")
    opened = [_open(p) for p in paths]
    roots = [layout for layout, fixed in opened if fixed is None]
    if step is None and len(roots) == 2:
        step = _newest_common(roots)
    elif step is None and len(roots) == 1:
        step = next(fixed for _, fixed in opened if fixed is not None)  # the step path's step, in the root
    sides = []
    for (layout, fixed), given in zip(opened, paths, strict=True):
        n = tools.resolve_step(layout, fixed if fixed is not None else step)
        sides.append(Side(layout, n, given.rstrip("/") if fixed is not None else f"{given} step {n}"))
    return sides[0], sides[1]


def _open(path: str) -> tuple[Layout, int | None]:
    """(root, step) for a step path, (root, None) for a root."""
    norm = os.path.normpath(path)
    step = parse_step(os.path.basename(norm))  # the one step-name pattern (store/guard.py)
    if step is not None:
        return tools.open_root(os.path.dirname(norm) or "."), step
    return tools.open_root(path), None


def _newest_common(roots: list[Layout]) -> int:
    """The newest step both roots hold (a resumed run against its reference)."""
    held = [layout.committed_steps() for layout in roots]
    common = set(held[0]) & set(held[1])
    if not common:
        listing = "; ".join(
            f"{layout.root}: {steps[-10:] or 'none'}" for layout, steps in zip(roots, held, strict=True)
        )
        raise CheckpointError(f"no step is committed in both roots ({listing}); name one with --step N")
    return max(common)


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
