"""The invariants, checked in the parent (which never had the fault layer), and the crash campaign driver."""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import safepoint
from safepoint.errors import CheckpointError
from safepoint.store.posix_layout import Layout
from tests.torture import durable, scenarios
from tests.torture.harness import Zygote

Save = tuple[int, int]  # (step, version)


@contextmanager
def fast_dir(prefix: str) -> Iterator[Path]:
    """A scratch directory on tmpfs where there is one (fsync is free there: the durability model is the
    fault layer's journal, not the disk), removed afterwards."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    path = base / f"safepoint-{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def record_figures(name: str, **figures: Any) -> None:
    """Append this test's counts to $SAFEPOINT_FIGURES (JSON lines), for docs/reliability.md."""
    out = os.environ.get("SAFEPOINT_FIGURES")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"test": name, **figures}) + "\n")


# ---- what the operation trace says must be there -------------------------------------------------------


@dataclasses.dataclass
class Expect:
    listed: dict[int, int]  # step -> version, once the next owner has recovered (what a kill leaves)
    durable: Save | None  # the newest save whose commit rename was followed by a completed fsync of ROOT
    saves: list[Save]  # baseline, then every save begun, in order
    deleted_durably: set[int]  # removed by retention, the removal fsynced
    returned: list[Save]  # saves whose save() returned

    @property
    def required(self) -> Save | None:
        """What a power loss must not take away: the newer of the last save() that returned (the user's
        promise) and the last commit made durable by an fsync of ROOT."""
        found = [s for s in (self.durable, *self.returned[-1:]) if s is not None]
        return max(found, key=self.saves.index, default=None)


def expect_from(
    j: durable.Journal, root: Path, baseline: list[Save], assume_done: frozenset[int] = frozenset()
) -> Expect:
    """What the journal says; ``assume_done``: operations begun but never journalled as finished, taken as
    done (see ``in_flight``)."""
    r = os.path.realpath(root)
    pend = os.path.join(r, ".pending") + os.sep

    def step_of(path: str) -> int | None:
        name = path[len(r) + 1 :] if path.startswith(r + os.sep) else ""
        return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None

    listed = dict(baseline)
    parked: dict[int, int] = {}
    saves = list(baseline)
    current: Save | None = None
    last_commit: Save | None = None
    durable_save = baseline[-1] if baseline else None
    deleted: set[int] = set()
    deleted_durably: set[int] = set()
    returned: list[Save] = []
    begun: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    for ev in j.events:
        events.append(ev)
        if ev["ev"] == "op" and ev["i"] in assume_done:
            events.append({"ev": "done", "i": ev["i"]})
    for ev in events:
        kind = ev["ev"]
        if kind == "mark" and ev["what"] == "begin":
            current = (ev["step"], ev["version"])
            saves.append(current)
        elif kind == "mark" and ev["what"] == "returned":
            returned.append((ev["step"], ev["version"]))
        elif kind == "op":
            begun[ev["i"]] = ev
        elif kind == "done":
            op = begun[ev["i"]]
            src, dst = op["path"], op.get("dst")
            if op["op"] == "rename" and dst is not None:
                n_dst, n_src = step_of(dst), step_of(src)
                if n_dst is not None and src.startswith(pend + "step-"):
                    assert current is not None and current[0] == n_dst, (current, op)
                    listed[n_dst] = current[1]
                    last_commit = current
                elif n_src is not None and dst.startswith(pend + "deleting-"):
                    listed.pop(n_src)
                    deleted.add(n_src)
                elif n_src is not None and dst.startswith(pend + "replaced-"):
                    parked[n_src] = listed.pop(n_src)
                elif n_dst is not None and src.startswith(pend + "replaced-"):
                    listed[n_dst] = parked.pop(n_dst)
            elif op["op"] == "exchange" and dst is not None and step_of(dst) is not None:
                assert current is not None
                listed[current[0]] = current[1]
                last_commit = current
            elif op["op"] == "fsync" and src == r:
                if last_commit is not None:
                    durable_save = last_commit
                deleted_durably |= deleted
    for n, v in parked.items():  # the next owner puts back a copy parked by an interrupted replacement
        listed.setdefault(n, v)
    return Expect(listed, durable_save, saves, deleted_durably, returned)


def in_flight(j: durable.Journal) -> frozenset[int]:
    """Operations another thread had begun when the SIGKILL landed, never journalled as finished: the
    layer journals an operation's end after the call returns, so each may or may not have reached the file
    system (with retention's deletes alongside the next save, or two writer threads)."""
    return frozenset(op["i"] for op in j.ops if op["state"] == "open")


# ---- checking one tree ------------------------------------------------------------------------------------


def check_tree(root: Path, exp: Expect, mode: str, alternatives: tuple[Expect, ...] = ()) -> list[str]:
    """Every invariant on one tree; returns the violations (empty: all hold). ``alternatives``: what the
    journal says with the operations in flight done (kill and data modes: the tree matches one of them)."""
    problems: list[str] = []
    layout = Layout(root)
    # Before anyone recovers anything: whatever is listed must verify.
    for s in layout.committed_steps() if root.exists() else []:
        try:
            layout.verify(s)
        except CheckpointError as e:
            problems.append(f"listed but does not verify (before recovery): {e}")
    m = scenarios.Model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with safepoint.CheckpointManager(root) as mgr:
                listed = [c.step for c in mgr.list()]
                step = mgr.restore(m.state)
        except CheckpointError as e:
            return [*problems, f"restore raised {type(e).__name__}: {e}"]
    for w in caught:
        if issubclass(w.category, safepoint.CheckpointWarning):
            problems.append(f"restore skipped a listed checkpoint: {w.message}")
    leftovers = sorted(p.name for p in (root / ".pending").iterdir())
    if leftovers:
        problems.append(f".pending not cleaned by the next owner: {leftovers}")
    for s in listed:
        try:
            layout.verify(s)
        except CheckpointError as e:
            problems.append(f"listed but does not verify: {e}")
    try:
        got: Save | None = (step, m.version()) if step else None
    except AssertionError as e:
        return [*problems, f"restored step {step}: {e}"]
    if mode in ("kill", "data"):
        # The namespace is exactly what the crash left: the listing is known to the step and version (up
        # to the operations in flight: exactly one of the outcomes they allow).
        exp = next((e for e in (exp, *alternatives) if sorted(e.listed) == listed), exp)
        want = sorted(exp.listed)
        if listed != want:
            problems.append(f"listed {listed}, expected {want}")
        newest = (want[-1], exp.listed[want[-1]]) if want else None
        if got != newest:
            problems.append(f"restored {got}, expected the newest committed {newest}")
    else:
        need = exp.required
        if got is None:
            if need is not None:
                problems.append(f"restored nothing, but {need} was committed durably: committed work lost")
        elif got not in exp.saves:
            problems.append(f"restored {got}: not a save that was made")
        elif need is not None and exp.saves.index(got) < exp.saves.index(need):
            problems.append(f"restored {got}, but {need} was committed durably: committed work lost")
        if listed and step != listed[-1]:
            problems.append(f"restored step {step}, not the newest listed {listed[-1]}")
        back = set(listed) & exp.deleted_durably
        if back:
            problems.append(f"steps {sorted(back)} were deleted durably, yet are listed again")
    return problems


# ---- the campaign -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    scope: Path
    journal: Path
    out: Path

    @property
    def root(self) -> Path:
        return self.scope / "ckpt"


def new_case(base: Path, name: str, template: Path | None) -> Case:
    case = Case(base / name / "scope", base / name / "journal", base / name / "out.json")
    if template is not None:
        shutil.copytree(template, case.scope, symlinks=True)
    else:
        case.scope.mkdir(parents=True)
    return case


def workload_cmd(case: Case, fault: dict[str, Any], **args: Any) -> dict[str, Any]:
    return {
        "scenario": args.pop("scenario", "workload"),
        "args": {"root": str(case.root), **args},
        "fault": {"scope": str(case.scope), "journal": str(case.journal), **fault},
        "out": str(case.out),
    }


def run_workload(zygote: Zygote, case: Case, fault: dict[str, Any], **args: Any) -> int:
    return zygote.run(workload_cmd(case, fault, **args), timeout=120)


def pipelined(
    zygote: Zygote, cases: Iterator[tuple[dict[str, Any], Callable[[int], None]]], timeout: float = 120
) -> None:
    """Run each (command, check) in a child; check a case in this process while the next child runs."""
    previous: Callable[[], None] | None = None
    for cmd, check in cases:
        zygote.start(cmd)
        if previous is not None:
            previous()
        code = zygote.wait(timeout)
        previous = functools.partial(check, code)
    if previous is not None:
        previous()


def crash_points(ops: list[dict[str, Any]], full: bool | str) -> list[int]:
    """Which k to crash at.

    True: every operation. False: every operation except the inside of runs of writes to one file: a
    crash between two writes of a file that is not yet fsynced or listed leaves the same state as one
    before the run's first or after its last write, so those two stand for the run. "no_writes": only
    the operations that are not writes (a write of an unfinished file is equivalent to the operation
    before or after its run, under every roll-back). "first_writes": those and the first write of each
    file.
    """
    if full is True:
        return [op["i"] for op in ops]
    if full == "no_writes":
        return [op["i"] for op in ops if op["op"] != "write"]
    if full == "first_writes":  # and the first write of each file, so that every kind is crashed at
        seen: set[str] = set()
        out = []
        for op in ops:
            if op["op"] != "write" or op["path"] not in seen:
                out.append(op["i"])
            if op["op"] == "write":
                seen.add(op["path"])
        return out
    keep = []
    for n, op in enumerate(ops):
        prev = ops[n - 1] if n else None
        nxt = ops[n + 1] if n + 1 < len(ops) else None

        def same(o: dict[str, Any] | None, op: dict[str, Any] = op) -> bool:
            return o is not None and o["op"] == "write" and o["path"] == op["path"]

        if op["op"] != "write" or not same(prev) or not same(nxt):
            keep.append(op["i"])
    return keep


@dataclasses.dataclass
class CrashResult:
    points: int = 0  # crash points tried (one child SIGKILLed at each)
    checks: int = 0  # trees checked: as the kill left it, after a power loss, after a data loss
    ops: int = 0  # operations counted in the clean run
    kinds: dict[str, int] = dataclasses.field(default_factory=dict)  # crash points per kind of operation
    violations: list[str] = dataclasses.field(default_factory=list)

    def of(self, *modes: str) -> list[str]:
        return [v for v in self.violations if any(f"[{m}]" in v for m in modes)]


def crash_campaign(
    zygote: Zygote,
    base: Path,
    template: Path | None,
    points: list[int] | Callable[[list[dict[str, Any]]], list[int]] | None,
    *,
    modes: tuple[str, ...] = ("kill", "power", "data"),
    baseline: list[Save] = scenarios.BASELINE,
    fault: dict[str, Any] | None = None,
    full: bool | str = False,
    **args: Any,
) -> CrashResult:
    """Count the operations of a clean run, then crash at each chosen k; check every tree."""
    fault = fault or {}
    counted = new_case(base, "count", template)
    assert run_workload(zygote, counted, {"mode": "count", **fault}, **args) == 0, zygote.log_tail()
    clean = durable.read(counted.journal)
    assert not clean.unknown, f"files created behind the fault layer's back: {clean.unknown}"
    ops = clean.ops
    chosen = crash_points(ops, full) if points is None else points(ops) if callable(points) else points
    result = CrashResult(ops=len(ops))
    by_i = {op["i"]: op for op in ops}
    # One writer thread, and retention's deletes drained after each save (scenarios.workload): the same
    # operations in the same order on every run (names aside).
    deterministic = args.get("writer_threads", 1) == 1 and args.get("drain", True)

    def check(k: int, case: Case, code: int) -> None:
        j = durable.read(case.journal)
        crashed = [op for op in j.ops if op["state"] == "crash"]
        if code != -9 or not crashed:
            result.violations.append(f"k={k}: the child did not crash there (exit {code})")
            return
        at = crashed[0]
        result.kinds[at["op"]] = result.kinds.get(at["op"], 0) + 1
        if deterministic and _shape(at, case.scope) != _shape(by_i[k], counted.scope):
            result.violations.append(
                f"k={k} [trace]: the crash run's operation {_shape(at, case.scope)} is not the clean run's "
                f"{_shape(by_i[k], counted.scope)}: the operation order is not deterministic"
            )
        where = f"k={k} ({at['op']} {_short(at['path'], case.scope)}" + (
            f" -> {_short(at['dst'], case.scope)})" if at.get("dst") else ")"
        )
        exp = expect_from(j, case.root, baseline)
        flying = in_flight(j)
        alternatives = (expect_from(j, case.root, baseline, flying),) if flying else ()
        trees = {}
        if "power" in modes:
            trees["power"] = case.scope.parent / "power"
            durable.rebuild_power(j, trees["power"])
        if "data" in modes:
            trees["data"] = case.scope.parent / "data"
            durable.rebuild_data(j, trees["data"])
        if j.unknown:
            result.violations.append(f"{where}: files created behind the fault layer's back: {j.unknown}")
        # The kill tree is checked last: checking takes ownership, which cleans up the real tree.
        for mode in [m for m in modes if m != "kill"] + (["kill"] if "kill" in modes else []):
            scope = trees.get(mode, case.scope)
            found = check_tree(scope / "ckpt", exp, mode, alternatives)
            result.checks += 1
            result.violations += [f"{where} [{mode}]: {p}" for p in found]
        result.points += 1
        shutil.rmtree(case.scope.parent, ignore_errors=True)

    def cases() -> Iterator[tuple[dict[str, Any], Callable[[int], None]]]:
        for k in chosen:
            case = new_case(base, f"k{k}", template)
            yield (
                workload_cmd(case, {"mode": "crash", "at": k, **fault}, **args),
                functools.partial(check, k, case),
            )

    pipelined(zygote, cases())
    return result


def _shape(op: dict[str, Any], scope: Path) -> tuple[str, str, str]:
    """An operation with the case's directory and the random ids in names taken out."""

    def norm(p: str | None) -> str:
        # Random ids: pending directories' "-<8..12 hex>", the lease token's ".<32 hex>".
        return re.sub(r"([-.])(?:[0-9a-f]{8,12}|[0-9a-f]{32})\b", r"\1<id>", _short(p or "", scope))

    return op["op"], norm(op["path"]), norm(op.get("dst"))


def _short(path: str, scope: Path) -> str:
    real = os.path.realpath(scope)
    return "<scope>" if path == real else path.replace(real + os.sep, "")


# ---- injected errors (ENOSPC / EIO) -----------------------------------------------------------------------


def save_windows(j: durable.Journal) -> list[tuple[Save, int, int, int | None]]:
    """(save, first op, last op, its commit op) for every save in a clean run's journal. A save's window
    ends when it returned or failed; where the workload drained the deleter after each save, when that
    was done: the retention pass the save started is part of it (a fault there is one in that save)."""
    windows: list[tuple[Save, int, int, int | None]] = []
    drained = any(ev["ev"] == "mark" and ev["what"] == "drained" for ev in j.events)
    ends = ("drained", "failed") if drained else ("returned", "failed")
    current: Save | None = None
    first = 0
    last = 0
    commit: int | None = None
    begun: dict[int, dict[str, Any]] = {}
    for ev in j.events:
        if ev["ev"] == "mark" and ev["what"] == "begin":
            current, first, commit = (ev["step"], ev["version"]), 0, None
        elif ev["ev"] == "op":
            begun[ev["i"]] = ev
            if current is not None:
                first = first or ev["i"]
                last = ev["i"]
                dst = ev.get("dst") or ""
                if ev["op"] in ("rename", "exchange") and os.path.basename(dst) == f"step-{current[0]}":
                    commit = ev["i"]
        elif ev["ev"] == "mark" and ev["what"] in ends and current is not None:
            windows.append((current, first, last, commit))
            current = None
    return windows


ERRNO_NAMES = {errno.ENOSPC: "ENOSPC", errno.EIO: "EIO"}


@dataclasses.dataclass
class FaultResult:
    injected: int = 0
    failed_saves: int = 0  # SaveError raised (the expected outcome before the commit point)
    violations: list[str] = dataclasses.field(default_factory=list)


def fault_campaign(
    zygote: Zygote,
    base: Path,
    template: Path,
    targets: Callable[[list[dict[str, Any]], list[tuple[Save, int, int, int | None]]], list[tuple[int, int]]],
    *,
    plan: list[Save],
    baseline: list[Save] = scenarios.BASELINE,
    fault_extra: dict[str, Any] | None = None,
    **args: Any,
) -> FaultResult:
    """Count a clean run, then fail each (op, errno) that ``targets`` picks, one child per fault.

    Invariants: the child never dies or hangs; a save that raised SaveError left the listing exactly as it
    was (nothing committed, older checkpoints intact) and nothing of itself in .pending; a save that did
    not raise is listed; a fault before the commit point always raises; the saves after the fault work
    (training continues); the final tree verifies and restores the newest save, exactly.
    """
    # A last save after the ones under test: retention left behind by a fault is retried there.
    plan = [*plan, (max(s for s, _ in plan) + 1, 99)]
    counted = new_case(base, "count", template)
    extra = fault_extra or {}
    assert run_workload(zygote, counted, {"mode": "count", **extra}, plan=plan, **args) == 0, (
        zygote.log_tail()
    )
    clean = durable.read(counted.journal)
    windows = save_windows(clean)[:-1]
    by_i = {op["i"]: op for op in clean.ops}
    keep = args.get("keep_last", scenarios.KEEP_LAST)
    result = FaultResult()

    def check(k: int, err: int, case: Case, code: int) -> None:
        op = by_i[k]
        save, _, _, commit = next(w for w in windows if w[1] <= k <= w[2])
        where = f"{ERRNO_NAMES.get(err, err)} at k={k} ({op['op']} {_short(op['path'], case.scope)}) in save {save}"
        bad = result.violations.append
        result.injected += 1
        out = json.loads(case.out.read_text()) if case.out.exists() else {}
        if code != 0:
            bad(f"{where} [child]: exited {code}: {out.get('exception')}: {out.get('message')}")
            return
        j = durable.read(case.journal)
        if not any(ev["ev"] == "fail" for ev in j.events):
            bad(f"{where} [child]: the fault was never reached")
            return
        outcomes = out["outcomes"]
        n = next(i for i, o in enumerate(outcomes) if (o["step"], o["version"]) == save)
        hit = outcomes[n]
        before = {int(s): v for s, v in hit["before"].items()}
        after = {int(s): v for s, v in hit["after"].items()}
        if not hit["ok"]:
            result.failed_saves += 1
            if after != before:
                bad(
                    f"{where} [lie]: SaveError says 'not committed', but the listing went {before} -> {after}"
                )
            if "not committed" not in hit["error"] or os.strerror(err) not in hit["error"]:
                bad(f"{where} [cause]: the error does not name the cause: {hit['error']}")
            mine = [p for p in hit["pending"] if p.startswith(f"step-{save[0]}-")]
            if mine:
                bad(f"{where} [pending]: the failed save left {mine} in .pending")
        else:
            if after.get(save[0]) != save[1]:
                bad(f"{where} [lie]: save() returned but {save} is not listed ({after})")
            if commit is None or k < commit:
                bad(f"{where} [swallowed]: a fault before the commit point, yet save() succeeded")
        for o in outcomes[n + 1 :]:
            if not o["ok"]:
                bad(f"{where} [continue]: training could not continue: {o['error']}")
        # The final tree, checked in this (never patched) process against what the child last listed.
        final = {int(s): v for s, v in outcomes[-1]["after"].items()}
        if len(final) != keep:
            bad(f"{where} [final]: retention left {sorted(final)} (keep_last={keep})")
        exp = Expect(final, None, [*baseline, *((o["step"], o["version"]) for o in outcomes)], set(), [])
        result.violations += [f"{where} [final]: {p}" for p in check_tree(case.root, exp, "kill")]
        shutil.rmtree(case.scope.parent, ignore_errors=True)

    def cases() -> Iterator[tuple[dict[str, Any], Callable[[int], None]]]:
        for k, err in targets(clean.ops, windows):
            assert any(w[1] <= k <= w[2] for w in windows), f"op {k} is not inside a save under test"
            case = new_case(base, f"k{k}-{err}", template)
            fault: dict[str, Any] = {"mode": "fail", "at": k, "err": err, **extra}
            if err == errno.ENOSPC:
                fault["sticky"] = ("open", "write", "mkdir")  # a full disk stays full until space is freed
            yield workload_cmd(case, fault, plan=plan, **args), functools.partial(check, k, err, case)

    pipelined(zygote, cases())
    return result


def reduce_writes(ops: list[dict[str, Any]], ks: list[int]) -> list[int]:
    """``ks`` without the inside of runs of writes to one file (see crash_points)."""
    keep = set(crash_points(ops, full=False))
    return [k for k in ks if k in keep]
