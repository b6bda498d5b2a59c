"""The async walk of this tree against a base revision's, in one process, alternated (CPU time per walk).

Two trees in two processes differ by a few percent whatever their code (hash seeds, memory layout): too
much to see whether a change to the walk's hot loop (``save/stage_plan.py``) costs the common state
anything. So this loads the base revision's ``stage_plan.py`` and ``kinds.py`` from git beside this tree's
and times ``walk(state, slots)`` of each on the same state, with the same buffers, alternating which goes
first each round. The state: N parameters (16 x 8 float32) and Adam's two moments per parameter in an
optimizer-like dict (3N tensors; N=3000: 9,000), its ``param_groups`` with the list of N parameter ids and
a ``betas`` tuple. Reported: the median CPU ms per walk of each and their ratio. Run::

    PYTHONPATH=src python benchmarks/bench_walk_ab.py --base main --params 3000 --rounds 40
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from safepoint.save import stage_plan
from safepoint.save.staging import Stager


def _base_walk(rev: str, into: Path) -> Any:
    """The base revision's ``walk``: its stage_plan.py importing its own kinds.py (as ``_base_kinds``)."""
    for name, module in (("kinds", "_base_kinds"), ("stage_plan", "_base_stage_plan")):
        src = subprocess.run(
            ["git", "show", f"{rev}:src/safepoint/save/{name}.py"], check=True, capture_output=True, text=True
        ).stdout
        (into / f"{module}.py").write_text(
            src.replace("from safepoint.save.kinds import", "from _base_kinds import")
        )
    sys.path.insert(0, str(into))
    import _base_stage_plan  # type: ignore[import-not-found]

    return _base_stage_plan.walk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="main")
    ap.add_argument("--params", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--walks", type=int, default=20, help="walks per variant per round")
    args = ap.parse_args()
    torch.manual_seed(0)
    n = args.params
    sd = {
        "model": {f"layer{i}.weight": torch.randn(16, 8) for i in range(n)},
        "optim": {
            "state": {i: {"exp_avg": torch.randn(16, 8), "exp_avg_sq": torch.rand(16, 8)} for i in range(n)},
            "param_groups": [{"params": list(range(n)), "lr": 1e-3, "betas": (0.9, 0.999)}],
        },
    }
    stager = Stager()
    stager.stage(sd)
    slots = stager._plan.slots  # type: ignore[union-attr]
    with tempfile.TemporaryDirectory() as tmp:
        base = _base_walk(args.base, Path(tmp))
        variants = {"base": base, "this": stage_plan.walk}
        assert len(base(sd, slots).leaves) == len(stage_plan.walk(sd, slots).leaves) == 3 * n
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        gc.collect()
        gc.disable()
        for r in range(args.rounds):
            for name in sorted(variants, reverse=r % 2 == 1):
                walk = variants[name]
                t0 = time.process_time()
                for _ in range(args.walks):
                    walk(sd, slots)
                cpu[name].append((time.process_time() - t0) / args.walks * 1e3)
        gc.enable()
    b, t = statistics.median(cpu["base"]), statistics.median(cpu["this"])
    print(f"tensors {3 * n}: base {b:.2f} ms, this tree {t:.2f} ms per walk (CPU, median); ratio {t / b:.4f}")


if __name__ == "__main__":
    main()
