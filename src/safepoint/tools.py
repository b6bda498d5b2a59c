"""The logic behind the ``safepoint`` command line: scan, verify, read, export, import, prune and diff.

cli.py parses arguments and renders; everything that touches a checkpoint lives here, on top of the same
modules the manager uses (Layout for the layout and commit protocol, SafeReader/SafeLoadPlanner for reads,
SyncSaver for writes, the retention policies, the lease). Nothing here unpickles arbitrary objects:
``.metadata`` goes through the restricted unpickler and every item through ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from safepoint.checksum import crc_hex
from safepoint.dist import Comm
from safepoint.errors import CheckpointError, CorruptCheckpointError
from safepoint.layout import STEP_PREFIX, CheckpointInfo, Layout
from safepoint.lease import Lease
from safepoint.manifest import MANIFEST_NAME, ORIGIN_IMPORT, ORIGIN_KEY, Manifest
from safepoint.policy import Retention
from safepoint.remote import RemoteLayout, is_url
from safepoint.saver import SyncSaver, describe_exception
from safepoint.state import MODEL, SECTIONS
from safepoint.storage import METADATA_NAME, SafeLoadPlanner, SafeReader, safe_load_metadata

OK = "ok"
CORRUPT = "corrupt"
PARTIAL = "partial"
TIER_LOCAL = "local"
TIER_DURABLE = "durable"  # a URL root (object store): ls and verify read it through RemoteLayout
_STEP_DIR = re.compile(rf"^{re.escape(STEP_PREFIX)}(\d+)$")
# Marks a safetensors file written by a full (not --model-only) export, whose keys carry section prefixes.
SAFETENSORS_LAYOUT_KEY = "safepoint.layout"

Include = Callable[[str], bool]


def everything(_key: str) -> bool:
    return True


def model_only(key: str) -> bool:
    return key.startswith(MODEL + ".")


# ---- root and step discovery -------------------------------------------------------------------------


def open_root(root: str, *, must_exist: bool = True) -> Layout:
    """A Layout for a local root; a clear error for URLs and missing or unreadable roots."""
    path = root[len("file://") :] if root.startswith("file://") else root
    if "://" in path:
        raise CheckpointError(f"{root}: this command reads local roots only (ls and verify also read URLs)")
    layout = Layout(path)
    if must_exist and not layout.root.exists():
        raise CheckpointError(f"checkpoint root {path} does not exist")
    layout.check_readable()
    return layout


def open_any_root(root: str) -> Layout | RemoteLayout:
    """``open_root``, or for a URL a RemoteLayout that verifies by reading every byte (endpoint and
    credentials come from the environment and AWS config, e.g. AWS_ENDPOINT_URL_S3, AWS_PROFILE)."""
    if is_url(root) and not root.startswith("file://"):
        try:
            return RemoteLayout(root, deep_verify=True)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    return open_root(root)


def _remote_steps(layout: RemoteLayout) -> dict[int, tuple[str, int, bool]]:
    """step -> (URL, bytes, has a manifest) for every ``step-N/`` prefix, from one listing."""
    out: dict[int, tuple[str, int, bool]] = {}
    for key, size in layout.store.sizes(layout.base).items():
        top, _, rest = key.partition("/")
        m = _STEP_DIR.match(top)
        if m and rest:
            step = int(m.group(1))
            _, total, has = out.get(step, (layout.step_path(step), 0, False))
            out[step] = (layout.step_path(step), total + size, has or rest == MANIFEST_NAME)
    return dict(sorted(out.items()))


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One ``step-N`` directory as ``ls`` reports it."""

    step: int
    path: str
    status: str
    bytes: int
    time: float | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    world_size: int | None = None
    reason: str | None = None
    tier: str = TIER_LOCAL

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _dir_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def step_dirs(layout: Layout | RemoteLayout) -> dict[int, Path | str]:
    """Every ``step-N`` directory, committed or not (Layout.committed_steps lists only committed ones)."""
    if isinstance(layout, RemoteLayout):
        return {step: url for step, (url, _, _) in _remote_steps(layout).items()}
    out: dict[int, Path | str] = {}
    for entry in os.scandir(layout.root):
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            out[int(m.group(1))] = Path(entry.path)
    return dict(sorted(out.items()))


def scan(layout: Layout | RemoteLayout, *, verify: bool = False) -> list[Entry]:
    """Every step directory, oldest first: ok, corrupt (manifest, or with ``verify`` a file) or partial."""
    entries = []
    if isinstance(layout, RemoteLayout):
        tier, found = TIER_DURABLE, _remote_steps(layout)
    else:
        tier = TIER_LOCAL
        found = {s: (str(p), -1, (Path(p) / MANIFEST_NAME).exists()) for s, p in step_dirs(layout).items()}
    for step, (path, size, committed) in found.items():
        nbytes = size if size >= 0 else _dir_bytes(Path(path))
        if not committed:
            # A save that never committed, or a removal interrupted mid-way: never loaded by restore.
            entries.append(
                Entry(step, path, PARTIAL, nbytes, reason="no manifest (never committed)", tier=tier)
            )
            continue
        try:
            manifest = layout.read_manifest(step)
        except CorruptCheckpointError as e:
            entries.append(Entry(step, path, CORRUPT, nbytes, reason=_where(e), tier=tier))
            continue
        info = layout.info(step, manifest)
        status, reason = OK, None
        if verify:
            try:
                layout.verify(step)
            except CorruptCheckpointError as e:
                status, reason = CORRUPT, _where(e)
        entries.append(
            Entry(step, info.path, status, info.bytes, info.time, info.metrics, info.world_size, reason, tier)
        )
    return entries


def pending_saves(layout: Layout | RemoteLayout) -> list[str]:
    if isinstance(layout, RemoteLayout):
        return sorted({k.split("/")[0] for k in layout.store.sizes(layout.pending_key)})
    try:
        return sorted(p.name for p in layout.pending_root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def resolve_step(layout: Layout | RemoteLayout, step: int | None) -> int:
    """``step`` if it is committed, else the newest committed step; a clear error otherwise."""
    committed = layout.committed_steps()
    if step is None:
        if not committed:
            raise CheckpointError(f"no committed checkpoint in {layout.root}")
        return committed[-1]
    if step not in committed:
        why = ""
        if isinstance(layout, Layout) and layout.step_path(step).is_dir():
            why = f" ({layout.step_path(step)} has no manifest: a save that never committed)"
        shown = committed[-10:] if committed else "none"
        raise CheckpointError(
            f"no committed checkpoint for step {step} in {layout.root}{why}; available: {shown}"
        )
    return step


# ---- verification ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    step: int
    file: str | None
    reason: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.file or 'checkpoint'}: {self.reason}"


def _where(e: CorruptCheckpointError) -> str:
    return f"{e.file}: {e.reason}" if e.file else e.reason


def verify_step(
    layout: Layout | RemoteLayout, step: int, on_file: Callable[[str, int], None] | None = None
) -> tuple[Manifest | None, list[Problem]]:
    """Check every file of ``step`` (size + crc32c) and report all problems, not only the first.

    Each file goes through Layout.verify so the checking rule lives in one place; ``on_file(name, size)``
    is called as each file finishes (progress). Files go one at a time: Layout.verify already reads a
    file's ranges in parallel, and a second pool on top would only oversubscribe the disk.
    """
    try:
        manifest = layout.read_manifest(step)
    except CorruptCheckpointError as e:
        return None, [Problem(step, e.file, e.reason)]
    problems: list[Problem] = []
    for name in sorted(manifest.files):
        try:
            layout.verify(step, files=[name])
        except CorruptCheckpointError as e:
            problems.append(Problem(step, e.file or name, e.reason))
        except KeyError:  # the manifest was replaced while we read it (a concurrent save of this step)
            problems.append(Problem(step, name, "the manifest changed during verification; run verify again"))
        if on_file is not None:
            on_file(name, manifest.files[name].size)
    if METADATA_NAME not in manifest.files:
        problems.append(Problem(step, METADATA_NAME, "not listed in the manifest (not a DCP checkpoint)"))
    return manifest, problems


def require_intact(layout: Layout, step: int, on_file: Callable[[str, int], None] | None = None) -> Manifest:
    manifest, problems = verify_step(layout, step, on_file)
    if problems or manifest is None:
        first = problems[0]
        more = f" (+{len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CorruptCheckpointError(step, first.file, first.reason + more)
    return manifest


def read_verified_metadata(layout: Layout, step: int, manifest: Manifest) -> Metadata:
    """DCP metadata of ``step``, checked against the manifest from the very bytes that are unpickled.

    Reading once and checking those bytes leaves no window in which the file could change between the
    check and the (restricted) unpickling.
    """
    entry = manifest.files.get(METADATA_NAME)
    if entry is None:
        raise CorruptCheckpointError(step, METADATA_NAME, "not listed in the manifest (not a DCP checkpoint)")
    try:
        data = (layout.step_path(step) / METADATA_NAME).read_bytes()
    except OSError as e:
        raise CorruptCheckpointError(step, METADATA_NAME, f"cannot read ({e.strerror or e})") from None
    if len(data) != entry.size:
        raise CorruptCheckpointError(step, METADATA_NAME, f"size {len(data)} != {entry.size}")
    crc = crc_hex(crc32c.crc32c(data))
    if crc != entry.crc32c:
        raise CorruptCheckpointError(
            step, METADATA_NAME, f"crc32c {crc} != {entry.crc32c} (contents altered)"
        )
    try:
        return safe_load_metadata(io.BytesIO(data))
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(step, METADATA_NAME, e.reason) from None


@dataclasses.dataclass(frozen=True, slots=True)
class KeyInfo:
    """One entry of a checkpoint as ``inspect`` shows it."""

    key: str
    section: str
    kind: str
    """'tensor' or 'object' (a non-tensor value, stored pickled and read with weights_only=True)."""
    shape: tuple[int, ...] | None
    dtype: str | None
    bytes: int
    """In-memory size for tensors; serialized size on disk for objects."""


def describe_keys(metadata: Metadata) -> list[KeyInfo]:
    stored: dict[str, int] = {}
    for index, where in (metadata.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(getattr(where, "length", 0) or 0)
    out = []
    for key, md in metadata.state_dict_metadata.items():
        section = key.split(".", 1)[0]
        if isinstance(md, TensorStorageMetadata):
            out.append(
                KeyInfo(
                    key, section, "tensor", tuple(md.size), _dtype(md.properties.dtype), tensor_nbytes(md)
                )
            )
        else:
            out.append(KeyInfo(key, section, "object", None, None, stored.get(key, 0)))
    return out


# ---- reading a whole checkpoint without a model ------------------------------------------------------


def tensor_nbytes(md: TensorStorageMetadata) -> int:
    return math.prod(md.size) * md.properties.dtype.itemsize


def planned_bytes(metadata: Metadata, include: Include = everything) -> int:
    return sum(
        tensor_nbytes(v)
        for k, v in metadata.state_dict_metadata.items()
        if include(k) and isinstance(v, TensorStorageMetadata)
    )


class _MaterializingPlanner(SafeLoadPlanner):
    """Builds the state dict from the metadata (like DCP's ``_EmptyStateDictLoadPlanner``), then loads it
    with SafeLoadPlanner's ``weights_only=True`` item loading; reports bytes as tensors land."""

    def __init__(self, include: Include, on_bytes: Callable[[int], None] | None) -> None:
        super().__init__()
        self.include = include
        self.on_bytes = on_bytes
        self.loaded: dict[str, Any] = {}

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if metadata is None:
            raise CheckpointError("DCP gave the planner no metadata")
        for key, md in metadata.state_dict_metadata.items():
            if not self.include(key):
                continue
            value: Any = md
            if isinstance(md, TensorStorageMetadata):
                value = torch.empty(md.size, dtype=md.properties.dtype)
            path = (metadata.planner_data or {}).get(key)
            if path is not None:
                set_element(state_dict, path, value)
            else:
                state_dict[key] = value
        self.loaded = state_dict
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if self.on_bytes is not None:
            self.on_bytes(tensor.numel() * tensor.element_size())


class _PreverifiedReader(SafeReader):
    """SafeReader that uses the metadata we already checked instead of reading ``.metadata`` again."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def load_state(
    layout: Layout,
    step: int,
    metadata: Metadata,
    include: Include = everything,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The nested state dict of a (verified) checkpoint, or the part of it ``include`` selects."""
    planner = _MaterializingPlanner(include, on_bytes)
    try:
        dcp_load({}, storage_reader=_PreverifiedReader(layout.step_path(step), metadata), planner=planner)
    except (CheckpointException, OSError, RuntimeError, ValueError) as e:
        # DCP wraps per-item failures; a refused item (UnsafeCheckpointError) is damage, not a usage error.
        failures = e.failures.values() if isinstance(e, CheckpointException) else []
        for exc, _tb in failures:
            if isinstance(exc, CorruptCheckpointError):
                raise CorruptCheckpointError(step, exc.file, exc.reason) from None
        raise CheckpointError(
            f"step {step}: reading the checkpoint failed: {describe_exception(e)}"
        ) from None
    return planner.loaded


# ---- export ------------------------------------------------------------------------------------------

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def convert_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: convert_floats(v, dtype) for k, v in obj.items()}
    return obj


def _atomic_write(out: Path, write: Callable[[Path], None]) -> None:
    """Write ``out`` through a temporary sibling and rename: a killed export never leaves half a file."""
    tmp = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_torch(obj: dict[str, Any], out: Path) -> None:
    _atomic_write(out, lambda p: torch.save(obj, p))


def _safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError:
        raise CheckpointError(
            "the safetensors format needs the safetensors package: pip install 'safepoint[safetensors]'"
        ) from None
    return st


def write_safetensors(obj: dict[str, Any], out: Path, meta: dict[str, str]) -> list[str]:
    """Flatten to dotted keys and write the tensors; returns the keys of non-tensor values left out
    (safetensors holds tensors only)."""
    st = _safetensors()
    flat, _ = flatten_state_dict(obj)
    tensors = {k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)}
    skipped = sorted(k for k, v in flat.items() if not isinstance(v, torch.Tensor))
    _atomic_write(out, lambda p: st.save_file(tensors, str(p), metadata=meta))
    return skipped


# ---- import ------------------------------------------------------------------------------------------


def read_import_source(src: Path, fmt: str) -> tuple[dict[str, Any], list[str]]:
    """The model state dict held by ``src`` and the top-level sections that were left out.

    Accepted: a flat ``{name: tensor}`` state dict (torch.save or safetensors), or a dict with a nested
    ``model`` state dict such as a full safepoint export (only ``model`` is taken; optimizer and other
    state is not in safepoint's format and is not imported).
    """
    if not src.is_file():
        raise CheckpointError(f"{src} does not exist or is not a file")
    if fmt == "auto":
        fmt = sniff_format(src)
    dropped: list[str] = []
    if fmt == "safetensors":
        st = _safetensors()
        try:
            flat: dict[str, Any] = st.load_file(str(src))
            from safetensors import safe_open

            with safe_open(str(src), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception as e:
            raise CheckpointError(f"cannot read {src} as safetensors: {e}") from None
        if meta.get(SAFETENSORS_LAYOUT_KEY) == "full":
            prefix = MODEL + "."
            dropped = sorted({k.split(".", 1)[0] for k in flat if not k.startswith(prefix)})
            flat = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
        model = flat
    else:
        try:
            # weights_only: tensors and plain containers only; a crafted pickle cannot run code.
            obj = torch.load(src, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"cannot read {src} as a torch.save file of plain tensors (torch.load with weights_only=True "
                f"refused it: {_weights_only_reason(e)})"
            ) from None
        if not isinstance(obj, Mapping):
            raise CheckpointError(f"{src} holds a {type(obj).__name__}, not a state dict")
        # A nested "model" mapping is unambiguous (a flat state dict maps names to tensors): a safepoint
        # export, or a training checkpoint like {"model": ..., "optimizer": ..., "epoch": 3}.
        if isinstance(obj.get(MODEL), Mapping):
            dropped = sorted(str(k) for k in obj if k != MODEL)
            obj = obj[MODEL]
        model = dict(obj)
    _check_flat_state_dict(src, model)
    return model, dropped


def sniff_format(src: Path) -> str:
    """'safetensors' or 'torch', from the first bytes rather than the name (files get renamed)."""
    with open(src, "rb") as f:
        head = f.read(9)
    # safetensors: u64 little-endian header length, then the JSON header; torch.save: a zip ("PK") or a
    # legacy pickle.
    if len(head) == 9 and head[8:9] == b"{" and not head.startswith(b"PK"):
        return "safetensors"
    return "torch"


def _weights_only_reason(e: Exception) -> str:
    # torch's message is mostly boilerplate around one informative line (the blocked global, say).
    boiler = (
        "Weights only load failed",
        "Please file an issue",
        "Check the documentation",
        "WeightsUnpickler",
    )
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith(boiler)]
    return " ".join(lines) or type(e).__name__


def _check_flat_state_dict(src: Path, sd: Mapping[Any, Any]) -> None:
    if not any(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(
            f"{src} holds no tensors at the top level (keys: {sorted(map(str, sd))[:8]}); expected a model "
            "state_dict or a safepoint export"
        )
    for k, v in sd.items():
        if not isinstance(k, str):
            raise CheckpointError(f"{src}: state dict key {k!r} is not a string")
        if isinstance(v, (Mapping, list, tuple)):
            raise CheckpointError(
                f"{src}: entry {k!r} is a {type(v).__name__}, not a tensor: the file is not a flat model "
                "state_dict (save model.state_dict() itself)"
            )


def import_state(model_sd: dict[str, Any], layout: Layout, *, force: bool) -> CheckpointInfo:
    """Commit ``model_sd`` as step 0 through the real save path (DCP write, crc32c, manifest, rename)."""
    layout.ensure_root()
    lease = Lease(layout.root)
    lease.acquire()
    try:
        if 0 in layout.committed_steps() and not force:
            raise CheckpointError(f"{layout.step_path(0)} already exists; pass --force to replace it")
        saver = SyncSaver(layout, Comm(), Retention())
        return saver.write(0, {MODEL: model_sd}, [MODEL], {}, {}, manifest_extra={ORIGIN_KEY: ORIGIN_IMPORT})
    finally:
        lease.release()


# ---- prune -------------------------------------------------------------------------------------------


def history(layout: Layout) -> list[CheckpointInfo]:
    """Committed checkpoints whose manifest parses; others are never counted as kept or deleted."""
    out = []
    for s in layout.committed_steps():
        try:
            out.append(layout.info(s, layout.read_manifest(s)))
        except CheckpointError:
            continue
    return out


def prune(layout: Layout, retention: Retention, *, dry_run: bool) -> tuple[list[int], list[int]]:
    """(kept, deleted) steps. Deletes under the lease, so it never races a live writer."""
    if dry_run:
        infos = history(layout)
        doomed = retention.to_delete(infos)
        return [c.step for c in infos if c.step not in doomed], doomed
    lease = Lease(layout.root)
    lease.acquire()
    try:
        infos = history(layout)  # read again under the lease: only now can nobody else be adding
        doomed = retention.to_delete(infos)
        for step in doomed:
            layout.remove(step)
        return [c.step for c in infos if c.step not in doomed], doomed
    finally:
        lease.release()


# ---- diff --------------------------------------------------------------------------------------------


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
        note = f"{_dtype(x.dtype)} vs {_dtype(y.dtype)}" if x.dtype != y.dtype else ""
        return DiffRow(key, "tensor", max_abs_diff(x, y), _bitwise_equal(x, y), note)
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return DiffRow(key, "object", detail="tensor vs non-tensor")
    try:
        same = type(x) is type(y) and bool(x == y)
    except (TypeError, ValueError, RuntimeError):
        same = False
    return DiffRow(key, "object", identical=same, detail="" if same else f"{_short(x)} vs {_short(y)}")


def _dtype(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _short(v: Any, n: int = 40) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def sections_of(keys: Iterable[str]) -> list[str]:
    return sorted(
        {k.split(".", 1)[0] for k in keys}, key=lambda s: (SECTIONS.index(s) if s in SECTIONS else 99, s)
    )
