"""The restore pipeline: discover -> verify -> read -> apply."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NoReturn

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from safepoint import errors
from safepoint import events as ev
from safepoint.data import rng
from safepoint.dist import Comm
from safepoint.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from safepoint.policy.rules import Verdicts
from safepoint.restore.compat import NotLoadable, check_compat, damage_first, report, section_prefixes
from safepoint.restore.free import check_loads_something, fill_free
from safepoint.restore.in_place import loaded_in_place
from safepoint.restore.leftover import Leftover, written_keys
from safepoint.restore.partial import Plan, RestoreReport, Selection, plan
from safepoint.restore.rank_sections import RankSections
from safepoint.restore.stateless import Dropped, check_named, drop_stateless
from safepoint.state import (
    DATALOADER,
    MODEL,
    OPTIMIZER,
    PER_RANK_SECTIONS,
    RNG,
    SCHEDULER,
    TrainState,
    rank_key,
)
from safepoint.store.guard import as_corruption
from safepoint.store.manifest import MANIFEST_NAME, ORIGIN_IMPORT, ORIGIN_KEY, Manifest
from safepoint.store.posix_layout import CheckpointStore
from safepoint.store.reader import SafeLoadPlanner

log = logging.getLogger("safepoint")
_REQUIRED = (MODEL, OPTIMIZER, SCHEDULER, DATALOADER)


class _DamagedWhileLoading(CorruptCheckpointError):
    """Found damaged while DCP was loading it: the objects restored into may be partly overwritten."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt or unreadable) and an older one used instead."""


class Restorer:
    events: ev.Events = ev.NO_EVENTS  # the manager's stream (events.py): each fallback

    def __init__(self, layout: CheckpointStore, comm: Comm, verdicts: Verdicts | None = None) -> None:
        self.layout = layout
        self.comm = comm
        self.verdicts = verdicts if verdicts is not None else Verdicts()  # read by retention
        self.selection = Selection()  # what the current restore() loads (its strict/ignore/remap)
        self.last_report: RestoreReport | None = None
        self.writing: frozenset[str] = frozenset()  # the keys the last load() wrote (or began to) in place

    # ---- discover + verify ---------------------------------------------------------------------------

    def choose(self, step: int | None, below: int | None = None) -> Manifest | None:
        """Newest checkpoint that verifies on every rank (or exactly ``step``); only steps before ``below``
        if given (after ``below`` failed to load). Collective."""
        steps = self.comm.broadcast(self.layout.committed_steps() if self.comm.is_coordinator else [])
        steps = [s for s in steps if below is None or s < below]
        if step is not None:
            if step not in steps:
                raise CheckpointError(
                    f"no committed checkpoint for step {step} in {self.layout.root} "
                    f"(available: {steps[-10:] if steps else 'none'})"
                )
            candidates = [step]
        else:
            candidates = sorted(steps, reverse=True)
        for candidate in candidates:
            try:
                manifest = self._verify_everywhere(candidate)
            except CorruptCheckpointError as e:
                self.verdicts.record(candidate, False)
                if step is not None:
                    raise
                self.skipping(e)
                continue
            self.verdicts.record(candidate, True)
            return manifest
        return None

    def restore_newest(self, state: TrainState, step: int | None) -> Manifest | None:
        """Choose, verify and load with one collective of our own plus DCP's (issue 15, item 4).

        Every rank lists the root and reads the newest candidate's manifest itself, verifies its share of
        the files, and one all_gather tells everyone whether all ranks saw the same manifest and found it
        intact; the check of the state against ``.metadata`` rides on DCP's plan collective. Ranks that
        disagree (a root not shared, a stale NFS listing) fall back to :meth:`restore`, where rank 0
        chooses; a candidate that fails is skipped like there (the next one costs another exchange)."""
        below: int | None = None
        damaged: CorruptCheckpointError | None = None
        leftover = Leftover()
        while True:
            candidate, manifest, problem = self._look(step, below)
            seen = self.comm.all_gather((candidate, manifest.save_id if manifest else None, problem))
            # What the ranks read (a data file one rank found damaged is corruption, decided below; a
            # manifest one rank could not read is a view that differs: rank 0 chooses).
            if len({(c, sid) for c, sid, _ in seen}) > 1:
                if self.comm.is_coordinator:
                    log.warning(
                        "safepoint: ranks see different checkpoints in %s (%s); rank 0 chooses",
                        self.layout.root,
                        sorted({(c, sid) for c, sid, _ in seen}, key=str)[:4],
                    )
                choose = functools.partial(self._choose_below, step, below)
                return self.restore(state, step, choose, leftover)
            if candidate is None:
                break
            if isinstance(problem, str):
                raise CheckpointError(problem)  # the step asked for is not committed (same on every rank)
            problems = [(r, p) for r, (_, _, p) in enumerate(seen) if isinstance(p, tuple)]
            try:
                if problems or manifest is None:
                    self._raise_problems(candidate, problems)
                self.load(manifest, state)
            except errors.UnsafeCheckpointError:
                raise
            except CorruptCheckpointError as e:
                self.verdicts.record(candidate, False)
                if step is not None:
                    raise
                self.skipping(e)
                # The first step that failed midway load stays the verdict: later candidates that fail
                # only verification load nothing and do not undo what it overwrote.
                below, damaged = candidate, damaged if isinstance(damaged, _DamagedWhileLoading) else e
                if isinstance(e, _DamagedWhileLoading):
                    leftover.failed(candidate, self.writing)
                continue
            self.verdicts.record(candidate, True)
            leftover.check(candidate, self.writing)
            return manifest
        if isinstance(damaged, _DamagedWhileLoading):
            raise CheckpointError(
                f"{damaged}; no older checkpoint could be loaded, and the objects being restored into were "
                "partly overwritten: recreate them before starting from scratch"
            )
        return None

    def _choose_below(self, step: int | None, start: int | None, below: int | None) -> Manifest | None:
        return self.choose(step, start if below is None else below)

    def _look(
        self, step: int | None, below: int | None
    ) -> tuple[int | None, Manifest | None, str | tuple[str | None, str] | None]:
        """This rank's view: (the candidate step or None, its manifest, and a message if ``step`` is not
        committed, or (file, reason) if this rank's share of the files does not verify, or None)."""
        steps = [s for s in self.layout.committed_steps() if below is None or s < below]
        if step is not None and step not in steps:
            return (
                step,
                None,
                (
                    f"no committed checkpoint for step {step} in {self.layout.root} "
                    f"(available: {steps[-10:] if steps else 'none'})"
                ),
            )
        candidate = step if step is not None else (max(steps) if steps else None)
        if candidate is None:
            return None, None, None
        try:
            raw = self.layout.manifest_bytes(candidate)
        except OSError as e:
            return candidate, None, (MANIFEST_NAME, f"cannot read manifest ({e.strerror or e})")
        try:
            manifest = Manifest.from_json(raw, step_hint=candidate)
        except CorruptCheckpointError as e:
            return candidate, None, (e.file, e.reason)
        try:
            self.layout.verify(
                candidate, files=sorted(manifest.files)[self.comm.rank :: self.comm.world_size], loading=True
            )
        except CorruptCheckpointError as e:
            return candidate, manifest, (e.file, e.reason)  # what this rank read agrees: the files do not
        return candidate, manifest, None

    def skipping(self, e: CorruptCheckpointError) -> None:
        self.events.emit(ev.RESTORE_FALLBACK, e.step, reason=str(e))
        if self.comm.is_coordinator:
            msg = f"safepoint: skipping corrupt checkpoint: {e}; falling back to an older one"
            errors.warn_caller(msg, CheckpointWarning)
            log.warning(msg)

    def restore(
        self,
        state: TrainState,
        step: int | None,
        choose: Callable[[int | None], Manifest | None],
        leftover: Leftover | None = None,
    ) -> Manifest | None:
        """``choose(below)`` a checkpoint and load it; a checkpoint that verified but turns out damaged while
        it is read (a file replaced since, a structural fault) is skipped like one that failed to verify.

        A failed read may have written into ``state``'s tensors already (they are loaded in place): the
        older checkpoint loaded then must overwrite every one of them, else restore raises naming those left
        (restore/leftover.py); if none loads, restore raises rather than return 0 with half-written state.
        """
        below: int | None = None
        damaged: CorruptCheckpointError | None = None
        leftover = leftover if leftover is not None else Leftover()
        while (manifest := choose(below)) is not None:
            try:
                self.load(manifest, state)
                leftover.check(manifest.step, self.writing)
                return manifest
            except errors.UnsafeCheckpointError:
                raise  # a crafted checkpoint that tried to run code: stop and say so, never skip quietly
            except CorruptCheckpointError as e:
                self.verdicts.record(manifest.step, False)  # verified, then found damaged while read
                if step is not None:
                    raise
                self.skipping(e)
                below, damaged = manifest.step, damaged if isinstance(damaged, _DamagedWhileLoading) else e
                if isinstance(e, _DamagedWhileLoading):
                    leftover.failed(manifest.step, self.writing)
        if isinstance(damaged, _DamagedWhileLoading):
            raise CheckpointError(
                f"{damaged}; no older checkpoint could be loaded, and the objects being restored into were "
                "partly overwritten: recreate them before starting from scratch"
            )
        return None

    def _verify_everywhere(self, step: int) -> Manifest:
        """Each rank checks a share of the files; everyone learns the first problem anyone found."""
        raw: bytes | str
        if self.comm.is_coordinator:
            try:
                raw = self.layout.manifest_bytes(step)
            except OSError as e:
                raw = f"cannot read manifest ({e.strerror or e})"
        else:
            raw = b""
        raw = self.comm.broadcast(raw)
        if isinstance(raw, str):
            raise CorruptCheckpointError(step, "safepoint.json", raw)
        manifest = Manifest.from_json(raw, step_hint=step)
        names = sorted(manifest.files)
        mine = names[self.comm.rank :: self.comm.world_size]
        problem: tuple[str | None, str] | None = None
        try:
            self.layout.verify(step, files=mine, loading=True)
        except CorruptCheckpointError as e:
            problem = (e.file, e.reason)
        problems = [(r, p) for r, p in enumerate(self.comm.all_gather(problem)) if p is not None]
        if not problems:
            return manifest
        self._raise_problems(step, problems)

    def _raise_problems(self, step: int, problems: list[tuple[int, tuple[str | None, str]]]) -> NoReturn:
        """Every rank holds the same ``problems``, so this extra exchange happens on all ranks or none."""
        hidden = self.comm.broadcast(self._visible_here(step, problems) if self.comm.is_coordinator else None)
        if hidden is not None:
            raise CheckpointError(
                f"checkpoint step {step}: file {hidden[1]!r} is intact as seen from rank 0, but rank "
                f"{hidden[0]} reports: {hidden[2]}. The checkpoint root {self.layout.root} is not shared by "
                "every rank (node-local?) or that rank's view of it is failing. Use a root every node can "
                "read (a shared file system or object storage), or copy the checkpoint to each node."
            )
        rank, (file, reason) = problems[0]
        where = f" (found by rank {rank})" if self.comm.distributed else ""
        raise CorruptCheckpointError(step, file, reason + where)

    def _not_loadable(self, step: int, found: list[tuple[int, CheckpointError]]) -> NoReturn:
        """Raise, on every rank alike, what the ranks found in DCP's planning step (``found``: the same
        list on every rank, from DCP's CheckpointException)."""
        for _, error in found:
            if isinstance(error, errors.UnsafeCheckpointError):
                raise errors.UnsafeCheckpointError(step, error.file, error.reason)
        for _, error in found:
            if isinstance(error, StateMismatchError):
                raise StateMismatchError(str(error))
        problems = [(r, (e.file, e.reason)) for r, e in found if isinstance(e, CorruptCheckpointError)]
        self._raise_problems(step, problems)

    def _visible_here(
        self, step: int, problems: list[tuple[int, tuple[str | None, str]]]
    ) -> tuple[int, str, str] | None:
        """A file another rank could not verify that verifies here: the root is not shared, not corrupt."""
        bad_here = {file for rank, (file, _) in problems if rank == self.comm.rank}
        for rank, (file, reason) in problems:
            if rank == self.comm.rank or file is None or file in bad_here:
                continue  # bad here too (every rank reads the manifest itself now): corrupt, not hidden
            if file != MANIFEST_NAME:  # the manifest was read here already
                try:
                    self.layout.verify(step, files=[file], loading=True)
                except CorruptCheckpointError:
                    continue
            return rank, file, reason
        return None

    # ---- read + apply --------------------------------------------------------------------------------

    def load(self, manifest: Manifest, state: TrainState) -> None:
        """Load ``manifest``'s (verified) checkpoint into ``state``. For a full restore, reading
        ``.metadata`` and checking the state against it happen inside DCP's planning step, whose collective
        carries any rank's failure to every rank before anything is loaded: no collective of our own. A
        partial restore (strict=False, ignore, remap) plans from ``.metadata`` first, and agrees with one
        all_gather."""
        step, sel = manifest.step, self.selection
        saved = set(manifest.keys)
        wanted = state.sections()
        ignored = [s for s in wanted if sel.ignores_section(s)]
        wanted = [s for s in wanted if s not in ignored]
        # An imported checkpoint (safepoint import) holds weights only: a run starting from it keeps its
        # fresh optimizer, scheduler and data position instead of refusing to start.
        imported = manifest.extra.get(ORIGIN_KEY) == ORIGIN_IMPORT
        absent = [s for s in wanted if s not in saved]
        for section in absent:
            if section in _REQUIRED and not imported and sel.strict:
                raise StateMismatchError(
                    f"checkpoint step {step} has no {section!r} state (it holds {sorted(saved)}); restore "
                    f"without {section}=... or pick a checkpoint that has it (or restore(strict=False))"
                )
            errors.warn_caller(
                f"safepoint: checkpoint step {step} has no {section!r} state; leaving it as is"
                + (" (an imported checkpoint holds weights only)" if imported else ""),
                CheckpointWarning,
            )
        sections = [s for s in wanted if s in saved]
        rank = self.comm.rank
        sources = {s: (rank if rank < manifest.world_size else 0) for s in PER_RANK_SECTIONS}
        template = state.load_template(sections, sources, rank)
        # Per-rank sections kept in rank files (store/rank_state.py): this rank reads the one file of the
        # saved rank it takes over, never the other ranks' state; DCP loads the rest.
        ranks = RankSections(self.layout, manifest, sections, sources[RNG])
        to_dcp = ranks.dcp_part(template)
        matched: Plan | None = None
        free = state.free_parts(sections, sources)  # need .metadata before the plan: the partial path
        dropped: Dropped = {}  # optimizer state the saved optimizer never had (restore/stateless.py)
        if sel.default and not free:

            def prepare() -> Metadata:
                # Inside DCP's planning step, on every rank: a failure here reaches every rank through
                # DCP's plan collective before anything is loaded (no collective of our own).
                md: Metadata | None = None
                try:
                    md = self.layout.read_metadata(step, manifest)
                    dropped.update(drop_stateless(template, md, self.layout, step))
                    check_compat(step, template, ranks.read(md))
                except (CorruptCheckpointError, StateMismatchError) as e:
                    raise NotLoadable(damage_first(self.layout, step, md, e)) from None
                return md

            reader = self.layout.make_reader(step, None, manifest)
            reader.prepare = prepare
        else:
            metadata: Metadata | None = None
            error: CheckpointError | None = None
            try:
                metadata = self.layout.read_metadata(step, manifest)
                checked = ranks.read(metadata)
                fill_free(template, free, checked, ranks.values)
                dropped.update(drop_stateless(template, metadata, self.layout, step))
                matched = plan(step, template, checked, tuple(section_prefixes(template)), sel)
                if not sel.strict:
                    check_loads_something(step, matched)
                to_dcp = ranks.split(matched.to_load)
            except (CorruptCheckpointError, StateMismatchError) as e:
                error = damage_first(self.layout, step, metadata, e)
            # Shards differ per rank: if any rank cannot load (or read .metadata), none may enter DCP's
            # collective load, and every rank decides alike from what all found, as on the default path.
            found = [(r, e) for r, e in enumerate(self.comm.all_gather(error)) if e is not None]
            if found:
                self._not_loadable(step, found)
            reader = self.layout.make_reader(step, metadata, manifest)
        self.writing = written_keys(template, matched)
        try:
            dcp_load(
                to_dcp,
                storage_reader=reader,
                planner=SafeLoadPlanner(),
                process_group=self.comm.group,
                no_dist=not self.comm.distributed,
            )
        except NotLoadable as e:  # no_dist: raised here directly
            self._not_loadable(step, [(rank, e.error)])
        except (CheckpointException, OSError, EOFError, RuntimeError, ValueError) as e:
            if isinstance(e, CheckpointException):
                found = [
                    (r, exc.error)
                    for r, (exc, _) in sorted(e.failures.items())
                    if isinstance(exc, NotLoadable)
                ]
                if found:
                    self._not_loadable(step, found)
            # DCP's exception is a BaseException; hand the caller our own error (the first rank's cause).
            # Metadata and shapes were checked above, so what fails now is the checkpoint's bytes.
            error = as_corruption(step, e)
            if isinstance(error, CorruptCheckpointError) and not isinstance(
                error, errors.UnsafeCheckpointError
            ):
                error = _DamagedWhileLoading(error.step, error.file, error.reason)
            raise error from None
        if matched is not None:
            matched.to_load.update(to_dcp)  # what DCP replaced (non-tensor values) in its own dict
            template = matched.put_back()
        else:
            template = ranks.filled(to_dcp)
        check_named(step, template, dropped, _DamagedWhileLoading)  # the bytes that shaped it, checked
        self.last_report = report(step, str(self.layout.root), matched, absent, ignored)
        derived = None
        if RNG in template and rank >= manifest.world_size:
            derived = rng.derived_seed(template[RNG][rank_key(0)], rank)
            msg = "safepoint: rank %d did not exist at save time (world size %d); RNG seeded with %d"
            log.info(msg + " (derived)", rank, manifest.world_size, derived)
        state.apply(template, sources, derived, loaded_in_place(state, template))
