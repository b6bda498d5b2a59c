"""The object-store campaigns: every mutation a save, a retention pass or an upload sends to S3, crashed at
or failed, one child per mutation.

The layer is real HTTP: the children talk to moto's server (tests/helpers/s3.py) through the fault proxy,
which counts every mutating request (PUT, upload-part, copy, multipart create/complete/abort, DELETE,
batch delete) in the order the store receives them. A child opens a session with its pid; at the k-th
mutation the proxy SIGKILLs it (just before the store sees the request, or just after the store applied
it), fails it (503 SlowDown until the child says the store is back, or one 403 AccessDenied), or applies
it and loses the answer (the child retries). Requests are sequential (``TransferOptions(concurrency=1)``)
so that the k-th mutation is the same request in every run.

After each crash the parent (never patched, and talking to moto directly) checks the store as the child
left it, then takes ownership as the next process would:

- before anyone recovers: every listed step verifies (a listed step is always complete);
- the listing is exactly what the journal says was committed (a manifest PUT the store applied, no
  manifest DELETE after it; a staged replacement whose old manifest is gone counts as its new version,
  as the next owner finishes it): nothing half uploaded or half deleted is listed;
- a fresh manager restores the newest of them, every tensor exactly that save's, with no warning;
- after it, the root holds only the listed checkpoints' objects (the next owner removed the rest).

Tiered: the same for the durable tier, then a fresh tiered manager restores the newest local checkpoint
and finishes the uploads, after which the durable tier's newest is that step.
"""

from __future__ import annotations

import dataclasses
import functools
import http.client
import json
import os
import re
import shutil
import time
import urllib.parse
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import safepoint
from safepoint.errors import CheckpointError
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.retry import MiB, TransferOptions
from safepoint.store import heartbeat
from safepoint.store.manifest import MANIFEST_NAME
from safepoint.tiers import journal_mirror
from tests.helpers import store_errors
from tests.torture import checks, scenarios
from tests.torture.harness import Zygote

Save = tuple[int, int]
# One data file of ~5.9 MB (weights and momentum of a 1024x720 layer): two parts of a 5 MiB multipart
# upload, so multipart create / upload-part / complete are crashed at too; .metadata and the manifest are
# single PUTs.
SHAPE = (1024, 720)
SMALL = (16, 8)  # the short campaigns: every object a single PUT, a quarter of the requests
PART = 5 * MiB
BASELINE: list[Save] = [(1, 10), (2, 20)]
# Direct: a new step (retention deletes step 1), a re-save of it (staged, promoted), a new step.
DIRECT_PLAN: list[Save] = [(3, 30), (3, 31), (4, 40)]
# Tiered: two saves, each uploaded (durable retention deletes steps 1 and 2).
TIERED_PLAN: list[Save] = [(3, 30), (4, 40)]
KEEP_LAST = 2
NO_HEARTBEAT_S = 86400.0  # a child's lease heartbeat interval: never within a run


def _no_mirror_thread(self: journal_mirror.JournalMirror) -> None:
    """JournalMirror.start in a campaign child: no thread, so only the final copy at close is made."""


def storage_options(endpoint: str, scheme: str = "s3") -> dict[str, Any]:
    """The test credentials travel with the options: the zygote's environment predates the fixtures."""
    if scheme == "gs":
        return {"endpoint_url": endpoint, "token": "anon", "project": "safepoint-test"}
    if scheme == "az":
        from tests.helpers.stores import azure_connection_string

        return {"connection_string": azure_connection_string(endpoint)}
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 5},
    }


def transfer(url: str) -> TransferOptions:
    # One request at a time (the k-th mutation is the same one every run); two attempts, no backoff, and
    # no retries of the client library's own (gcsfs's and the Azure SDK's wait 1 to 24 s between tries).
    # Except one on gs://: DCP's streamed writes of a direct root go through gcsfs's resumable upload,
    # which only gcsfs retries (docs/storage.md, client_retries).
    retries = 1 if url.startswith("gs://") else 0
    return TransferOptions(concurrency=1, attempts=2, backoff_s=0.0, part_size=PART, client_retries=retries)


class FrozenModel(scenarios.Model):
    """The campaigns' state: scenarios.Model (every trained tensor and the optimizer's set to the save's
    version) and a frozen tensor (``requires_grad=False``, outside the optimizer, as a LoRA base) that never
    changes. Its bytes equal the previous save's, so from the second save on it lies in a stable group, and
    each later save *copies* that group server-side (S3 CopyObject, GCS rewrite, Azure Copy Blob;
    remote/incremental_copy.py): the crash points include those copies.

    ``blank``: the frozen tensor starts as zeros (a checker's fresh model), so only a restore puts its
    bytes back, and ``version()`` then proves they are bit for bit the ones saved."""

    def __init__(self, shape: tuple[int, int] = SHAPE, blank: bool = False) -> None:
        super().__init__(shape)
        self.expected = torch.randn(shape, generator=torch.Generator().manual_seed(7))
        frozen = torch.zeros(shape) if blank else self.expected.clone()
        self.model.frozen = torch.nn.Parameter(frozen, requires_grad=False)

    def tensors(self) -> list[torch.Tensor]:
        """The trained tensors (``fill`` sets them to a version); never the frozen one."""
        frozen = self.model.frozen.data_ptr()  # (``.data`` is a new tensor object at every access)
        return [t for t in super().tensors() if t.data_ptr() != frozen]

    def version(self) -> int:
        v = super().version()
        assert torch.equal(self.model.frozen, self.expected), "the frozen tensor is not the one saved"
        return v


# ---- the child ------------------------------------------------------------------------------------------


class Control:
    """The child's side of the proxy's session protocol (plain HTTP, outside s3fs)."""

    def __init__(self, endpoint: str) -> None:
        u = urllib.parse.urlsplit(endpoint)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80

    def post(self, kind: str, **msg: Any) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            msg["t"] = round(time.monotonic(), 3)
            conn.request("POST", f"/__safepoint__/{kind}", body=json.dumps(msg).encode())
            conn.getresponse().read()
        finally:
            conn.close()


def _versions(layout: RemoteLayout) -> dict[int, int]:
    out = {}
    for s in layout.committed_steps():
        try:
            out[s] = int(layout.read_manifest(s).metrics.get("version", -1))
        except CheckpointError:
            out[s] = -1
    return out


def _state(layout: RemoteLayout) -> tuple[dict[int, int], list[str]]:
    """(step -> version of every listed step, the listed steps that do not verify: must be none)."""
    versions, torn = {}, []
    for s in layout.committed_steps():
        try:
            versions[s] = int(layout.verify(s).metrics.get("version", -1))
        except CheckpointError as e:
            torn.append(str(e))
            versions[s] = -1
    return versions, torn


def workload(
    layer: object,
    url: str,
    proxy: str,
    case: str,
    session: dict[str, Any],
    plan: list[list[int]],
    local_root: str | None = None,
    keep_last: int = KEEP_LAST,
    patches: list[str] = (),  # type: ignore[assignment]
    shape: tuple[int, int] = SHAPE,
    scheme: str = "s3",
) -> dict[str, Any]:
    """Save each (step, version) of ``plan`` to ``url`` (through the proxy); tiered with ``local_root``
    (each save is waited for: its upload is part of it). A failed save is reported, the fault disarmed
    (the store is back) and training goes on."""
    apply_mutations(patches)
    ctl = Control(proxy)
    ctl.post("hello", case=case, pid=os.getpid(), **session)
    m = FrozenModel(tuple(shape))  # type: ignore[arg-type]
    opts = storage_options(proxy, scheme)
    durable = RemoteLayout(url, opts)
    failing = session.get("mode") in ("fail", "lost")
    outcomes: list[dict[str, Any]] = []
    ctl.post("mark", what="start")
    # No lease heartbeat inside a child: a beat is a mutation (a PUT of .lease) sent every 15 s wherever the
    # run has got to, so a run slowed past 15 s by load sent one more than the clean run and every later k
    # named another request ([trace]). The next owner takes a dead child's lease over by its pid (one host).
    heartbeat.HEARTBEAT_S = NO_HEARTBEAT_S
    # Nor the run journal's copies on the mirror's own thread (after a commit, then every 30 s): on that
    # thread they land among the save's requests wherever the scheduler puts them, so a loaded run's k-th
    # mutation was a journal PUT where the clean run's was a delete ([trace]). The final copy, made on this
    # thread at close, stays; the journal is advisory and never checked here (ROOT/.run/ is left out).
    journal_mirror.JournalMirror.start = _no_mirror_thread  # type: ignore[method-assign]
    cluster = safepoint.ClusterOptions(lease_stale_after_s=4 * NO_HEARTBEAT_S)
    with safepoint.CheckpointManager(
        url,
        local_root=local_root,
        storage_options=opts,
        transfer=transfer(url),
        cluster=cluster,
        keep=safepoint.Keep(last=keep_last),
    ) as mgr:
        ctl.post("mark", what="ready")
        for step, version in plan:
            m.fill(version)
            # The store's listing around each save (fail campaigns only: listing costs requests and time).
            before = _versions(durable) if failing else {}
            ctl.post("mark", what="begin", step=step, version=version)
            outcome: dict[str, Any] = {"step": step, "version": version, "ok": True}
            try:
                mgr.save(step, m.state, metrics={"version": version}, overwrite=True)  # PLAN replaces a step
                ctl.post("mark", what="saved", step=step, version=version)
                if local_root is not None:
                    mgr.wait()  # the upload (and durable retention) of this save
                ctl.post("mark", what="returned", step=step, version=version)
                if local_root is None:
                    # Retention's deletes run on the deleter thread: drained before the next save, so
                    # every run sends the same requests in the same order (the campaign's crash points).
                    mgr.wait()
            except safepoint.SaveError as e:
                outcome.update(ok=False, error=str(e))
                ctl.post("mark", what="failed", step=step, version=version)
            if failing:
                ctl.post("disarm")  # the store is back: training goes on
                after, torn = _state(durable)
                outcome.update(before=before, after=after, torn=torn)
            outcomes.append(outcome)
        ctl.post("mark", what="closing")
    ctl.post("mark", what="closed")
    return {"outcomes": outcomes}


def apply_mutations(names: list[str]) -> None:
    """*Mutations*: break the store protocol inside this child only; the campaigns must catch each."""
    from safepoint.remote import object_layout as remote

    for name in names:
        if name == "manifest_first":  # an upload sends the manifest before the data it lists

            def put_files(
                self: Any, pending: str, files: Any, _real: Any = remote.RemoteLayout.put_files
            ) -> None:
                local_dir = os.path.dirname(files[0][0])
                with open(os.path.join(local_dir, MANIFEST_NAME), "rb") as f:
                    self.store.put_bytes(f"{pending}/{MANIFEST_NAME}", f.read())
                _real(self, pending, files)

            remote.RemoteLayout.put_files = put_files  # type: ignore[method-assign]
        elif name == "copy_before_unlisting":  # a re-save copies over step N before deleting its manifest

            def promote(
                self: Any, staged: str, manifest: Any, _real: Any = remote.RemoteLayout._promote
            ) -> None:
                final = self.step_key(manifest.step)
                for n in sorted(manifest.files):
                    self.store.copy(
                        f"{staged}/{n}", f"{final}/{n}", manifest.files[n].size, manifest.files[n].crc32c
                    )
                _real(self, staged, manifest)

            remote.RemoteLayout._promote = promote  # type: ignore[method-assign]
        elif name == "delete_data_first":  # retention deletes the data, then the manifest

            def remove(self: Any, step: int) -> None:
                key = self.step_key(step)
                names = [k for k in self.store.sizes(key) if k != MANIFEST_NAME]
                self.store.delete([f"{key}/{n}" for n in sorted(names)])
                self.store.delete([f"{key}/{MANIFEST_NAME}"])

            remote.RemoteLayout.remove = remove  # type: ignore[method-assign]
        elif name == "resave_in_place":  # a re-save overwrites the committed copy in place

            def new_pending(self: Any, step: int, save_id: str) -> str:
                return str(self.step_key(step))

            remote.RemoteLayout.new_pending = new_pending  # type: ignore[method-assign]
        # Bugs this campaign found, put back:
        elif name == "promotion_discards_staged":  # a re-save failing midway let its staged copy be deleted

            def replace(self: Any, staged: str, manifest: Any) -> None:
                try:
                    self._promote(staged, manifest)
                except BaseException:
                    self._unfinished.pop(staged, None)
                    raise

            remote.RemoteLayout._replace = replace  # type: ignore[method-assign]
        elif name == "retention_raises_upload_error":  # a failed retention delete failed the committed save
            # The bug had two halves, both put back: remove let the store's UploadError (not an OSError)
            # out, and retention, which ran in the saving thread after the commit and took only OSError
            # for a cleanup to retry, let it out of the save. Retention now runs on the deleter thread and
            # logs whatever a pass raises, so the second half is put back as the old design: the pass
            # runs in the saving thread (inline mode) and the store's error escapes it.
            from safepoint.policy import retainer
            from safepoint.remote.upload import UploadError

            failed: list[UploadError] = []

            def remove_raising(self: Any, step: int, failed: list[UploadError] = failed) -> None:
                try:
                    self.store.delete([f"{self.step_key(step)}/{MANIFEST_NAME}"])
                except UploadError as e:
                    failed.append(e)
                    raise
                self.discard(self.step_key(step), manifest_deleted=True)

            def init(self: Any, *a: Any, _real: Any = retainer.Retainer.__init__, **kw: Any) -> None:
                _real(self, *a, **{**kw, "background": False})

            def process(
                self: Any,
                batch: Any,
                _real: Any = retainer.Retainer._process,
                failed: list[UploadError] = failed,
            ) -> None:
                _real(self, batch)
                if failed:
                    raise failed.pop()

            remote.RemoteLayout.remove = remove_raising  # type: ignore[method-assign]
            retainer.Retainer.__init__ = init  # type: ignore[method-assign]
            retainer.Retainer._process = process  # type: ignore[method-assign]
        elif name == "bulk_delete_ignores_errors":  # s3fs's rm: per-key errors of a batch delete ignored
            from safepoint.remote import s3store
            from safepoint.remote.upload import ObjectStore

            s3store.S3Store.delete = ObjectStore.delete  # type: ignore[method-assign]
        elif name == "stream_error_not_oserror":  # torch's zip writer hid a failed part as "unexpected pos"
            # As it was: the store's error went into torch's writer as a non-OSError (StreamWriteError is an
            # OSError now), and a message named only an OSError found along the chain (today safepoint's own
            # errors are named too). Both halves, or the cause is still named and nothing is re-created.
            from safepoint import errors
            from safepoint.remote import stream
            from safepoint.remote.upload import StreamWriteError

            send = stream.PartWriter._send

            def unwrapped(self: Any, chunk: bytes, _send: Any = send) -> None:
                failed: BaseException | None = None
                try:
                    _send(self, chunk)
                except StreamWriteError as e:
                    failed = e.__cause__ or e
                if failed is not None:  # raised outside the handler: no OSError left in its context
                    failed.__context__ = None
                    raise failed

            stream.PartWriter._send = unwrapped  # type: ignore[method-assign]
            errors._named_cause = errors.os_error_in_chain
        else:
            raise ValueError(f"unknown mutation {name!r}")


# ---- the parent: the store -----------------------------------------------------------------------------


class Store:
    """The parent's direct line to moto (never through the proxy)."""

    scheme = "s3"

    def __init__(self, endpoint: str, bucket: str) -> None:
        import boto3

        self.endpoint, self.bucket = endpoint, bucket
        self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    @property
    def options(self) -> dict[str, Any]:
        return storage_options(self.endpoint, self.scheme)

    def via(self, proxy: str) -> str:
        """The endpoint a child uses: the proxy's (Azurite's path names the account: kept)."""
        return proxy + urllib.parse.urlsplit(self.endpoint).path

    def url(self, prefix: str) -> str:
        return f"{self.scheme}://{self.bucket}/{prefix}"

    def keys(self, prefix: str) -> list[str]:
        out = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix + "/"
        ):
            out += [o["Key"][len(prefix) + 1 :] for o in page.get("Contents", [])]
        return sorted(out)

    def copy(self, src: str, dst: str) -> None:
        for k in self.keys(src):
            self.s3.copy_object(
                Bucket=self.bucket,
                Key=f"{dst}/{k}",
                CopySource={"Bucket": self.bucket, "Key": f"{src}/{k}"},
                ChecksumAlgorithm="CRC32C",
            )

    def delete(self, prefix: str) -> None:
        keys = self.keys(prefix)
        for i in range(0, len(keys), 1000):
            objs = [{"Key": f"{prefix}/{k}"} for k in keys[i : i + 1000]]
            self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": objs})
        for up in self.s3.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix + "/").get("Uploads", []):
            self.s3.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])

    def get(self, key: str) -> bytes:
        """The object ``key``'s bytes (b"" if there is none)."""
        try:
            return bytes(self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except self.s3.exceptions.NoSuchKey:
            return b""

    def open_uploads(self, prefix: str) -> int:
        return len(self.s3.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix + "/").get("Uploads", []))


class FsStore(Store):
    """The parent's direct line to fake-gcs-server or Azurite, through the store's own fsspec file system."""

    def __init__(self, scheme: str, endpoint: str, bucket: str) -> None:
        from fsspec.core import url_to_fs

        self.scheme, self.endpoint, self.bucket = scheme, endpoint, bucket
        self.fs, _ = url_to_fs(f"{scheme}://{bucket}", skip_instance_cache=True, **self.options)

    def keys(self, prefix: str) -> list[str]:
        base = f"{self.bucket}/{prefix}"
        self.fs.invalidate_cache()
        try:
            keys = (p[len(base) + 1 :] for p in self.fs.find(base))
            return sorted(k for k in keys if not k.startswith(".run/"))  # the run journal (journal_mirror.py)
        except FileNotFoundError:
            return []

    def copy(self, src: str, dst: str) -> None:
        for k in self.keys(src):
            self.fs.copy(f"{self.bucket}/{src}/{k}", f"{self.bucket}/{dst}/{k}")

    def delete(self, prefix: str) -> None:
        if keys := self.keys(prefix):
            self.fs.rm([f"{self.bucket}/{prefix}/{k}" for k in keys])

    def get(self, key: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(f"{self.bucket}/{key}"))
        except FileNotFoundError:
            return b""

    def open_uploads(self, prefix: str) -> int:
        return 0  # uncommitted blocks and resumable sessions are invisible and expire by themselves


def make_baseline(store: Store, prefix: str, local: Path | None, shape: tuple[int, int] = SHAPE) -> None:
    """Commit BASELINE (a clean run, direct to moto): on the store, and with ``local`` tiered. Step 2 holds
    the frozen tensor in a stable group of its own, which every save of a campaign's plan copies."""
    m = FrozenModel(shape)
    opts = store.options
    with safepoint.CheckpointManager(
        store.url(prefix),
        local_root=local,
        storage_options=opts,
        transfer=transfer(store.url(prefix)),
        keep=safepoint.Keep(last=KEEP_LAST),
    ) as mgr:
        for step, version in BASELINE:
            m.fill(version)
            mgr.save(step, m.state, metrics={"version": version})
            mgr.wait()


# ---- what the journal says must be listed --------------------------------------------------------------


@dataclasses.dataclass
class Expect:
    listed: dict[int, int]  # step -> version once the next owner has recovered
    saves: list[Save]  # baseline, then every save begun
    returned: list[Save]  # saves whose save() (and, tiered, wait()) returned
    saved: list[Save]  # saves whose save() returned (tiered: committed locally)
    late: int = 0  # mutations that reached the store after the client died


def expect_from(events: list[dict[str, Any]], root_key: str, baseline: list[Save], fixed: bool) -> Expect:
    """Replay the mutations the store applied. ``fixed``: a step's version is the plan's for it (tiered:
    the uploader runs behind the saves); else the version of the save in progress."""
    manifest = re.compile("^" + re.escape(root_key) + r"/step-(\d+)/safepoint\.json$")
    staged_manifest = re.compile(
        "^" + re.escape(root_key) + r"/\.pending/step-(\d+)-[0-9a-f]+/safepoint\.json$"
    )
    listed = dict(baseline)
    staged: dict[int, int] = {}
    saves, returned, saved = list(baseline), [], []
    plan_version: dict[int, int] = dict(baseline)
    current: Save | None = None
    ops: dict[int, dict[str, Any]] = {}
    late = 0

    def version(step: int) -> int:
        if fixed or current is None:
            return plan_version[step]
        return current[1]

    def apply(op: dict[str, Any]) -> None:
        if op["op"] == "put":
            if m := manifest.match(op["key"]):
                listed[int(m.group(1))] = version(int(m.group(1)))
            elif m := staged_manifest.match(op["key"]):
                staged[int(m.group(1))] = version(int(m.group(1)))
        elif op["op"] in ("delete", "delete-batch"):
            for key in op.get("keys") or [op["key"]]:
                if m := manifest.match(key):
                    listed.pop(int(m.group(1)), None)
                elif m := staged_manifest.match(key):
                    staged.pop(int(m.group(1)), None)

    for ev in events:
        kind = ev["ev"]
        if kind == "mark" and ev["what"] == "begin":
            current = (ev["step"], ev["version"])
            saves.append(current)
            plan_version[ev["step"]] = ev["version"]
        elif kind == "mark" and ev["what"] == "returned":
            returned.append((ev["step"], ev["version"]))
        elif kind == "mark" and ev["what"] == "saved":
            saved.append((ev["step"], ev["version"]))
        elif kind == "op":
            ops[ev["i"]] = ev
        elif kind == "late":
            late += 1
            apply(ev)
        elif kind == "done" and int(ev["status"]) < 300 and ev["i"] in ops:  # (a late one: applied above)
            apply(ops[ev["i"]])
    for step, v in staged.items():  # the next owner finishes a replacement whose old manifest is gone
        listed.setdefault(step, v)
    return Expect(listed, saves, returned, saved, late)


# ---- checking one store ---------------------------------------------------------------------------------


def check_store(
    store: Store, prefix: str, exp: Expect | None, want_listed: dict[int, int] | None, shape: tuple[int, int]
) -> list[str]:
    """Every invariant on a direct root; ``want_listed``: the exact listing (None: only what holds always)."""
    problems: list[str] = []
    url, opts = store.url(prefix), store.options
    layout = RemoteLayout(url, opts)
    for s in layout.committed_steps():  # before anyone recovers anything
        try:
            layout.verify(s)
        except CheckpointError as e:
            problems.append(f"listed but does not verify (before recovery): {e}")
    m = FrozenModel(shape, blank=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with safepoint.CheckpointManager(url, storage_options=opts) as mgr:
                listing = {c.step: int(c.metrics.get("version", -1)) for c in mgr.list()}
                step = mgr.restore(m.state)
        except CheckpointError as e:
            return [*problems, f"restore raised {type(e).__name__}: {e}"]
    problems += [f"restore skipped a listed checkpoint: {w.message}" for w in caught if _ours(w)]
    try:
        got: Save | None = (step, m.version()) if step else None
    except AssertionError as e:
        return [*problems, f"restored step {step}: {e}"]
    if want_listed is not None and listing != want_listed:
        problems.append(f"listed {listing}, expected {want_listed}")
    newest = max(listing.items()) if listing else None
    if got != newest:
        problems.append(f"restored {got}, not the newest listed {newest}")
    if exp is not None and exp.returned and got is not None:
        need = exp.returned[-1]
        if exp.saves.index(got) < exp.saves.index(need):
            problems.append(f"restored {got}, older than {need}, whose save returned: committed work lost")
    problems += _garbage(store, prefix, layout, listing)
    return problems


def _ours(w: warnings.WarningMessage) -> bool:
    return issubclass(w.category, safepoint.CheckpointWarning)


def _garbage(store: Store, prefix: str, layout: RemoteLayout, listing: dict[int, int]) -> list[str]:
    """Objects the next owner left that belong to no listed checkpoint."""
    allowed = set()
    for s in listing:
        allowed |= {f"step-{s}/{n}" for n in layout.read_manifest(s).files} | {f"step-{s}/safepoint.json"}
    # ROOT/.run/ is the run journal's copy (tiers/journal_mirror.py): the run's record, never garbage.
    extra = [k for k in store.keys(prefix) if k not in allowed and not k.startswith(".run/")]
    problems = [f"left behind after the next owner's cleanup: {extra}"] if extra else []
    if n := store.open_uploads(prefix):
        problems.append(f"{n} multipart upload(s) left open after the next owner's cleanup")
    return problems


def check_tiered(
    store: Store, prefix: str, local: Path, exp: Expect, want_durable: dict[int, int], shape: tuple[int, int]
) -> list[str]:
    """The durable tier as left (exactly the journal's listing, every step verifies), then a fresh tiered
    manager: restores the newest local save exactly, finishes the uploads, cleans the durable tier."""
    problems: list[str] = []
    url, opts = store.url(prefix), store.options
    durable = RemoteLayout(url, opts)
    for s in durable.committed_steps():
        try:
            durable.verify(s)
        except CheckpointError as e:
            problems.append(f"durable step listed but does not verify (before recovery): {e}")
    listed = _versions(durable)
    if listed != want_durable:
        problems.append(f"durable tier lists {listed}, expected {want_durable}")
    m = FrozenModel(shape, blank=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with safepoint.CheckpointManager(
                url, local_root=local, storage_options=opts, keep=safepoint.Keep(last=KEEP_LAST)
            ) as mgr:
                step = mgr.restore(m.state)
                mgr.wait()
                lag = mgr.durability_lag()
        except CheckpointError as e:
            return [*problems, f"the next owner raised {type(e).__name__}: {e}"]
    problems += [f"restore skipped a checkpoint: {w.message}" for w in caught if _ours(w)]
    try:
        got: Save | None = (step, m.version()) if step else None
    except AssertionError as e:
        return [*problems, f"restored step {step}: {e}"]
    want = exp.saved[-1] if exp.saved else BASELINE[-1]
    if got != want:
        problems.append(f"restored {got}, expected the newest local save {want}")
    if lag.durable_step != want[0] or lag.uploads_pending:
        problems.append(f"after the next owner's uploads: {lag}, expected step {want[0]} durable")
    after = _versions(durable)
    for s in after:
        try:
            durable.verify(s)
        except CheckpointError as e:
            problems.append(f"durable step does not verify after the next owner: {e}")
    if after.get(want[0]) != want[1]:
        problems.append(f"durable tier lists {after} after the next owner, expected {want} in it")
    problems += _garbage(store, prefix, durable, after)
    return problems


# ---- the campaigns --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    ops: int = 0  # mutations in the clean run
    points: int = 0  # cases run (crash points, injected faults)
    kinds: dict[str, int] = dataclasses.field(default_factory=dict)  # cases per kind of mutation
    failed_saves: int = 0  # saves that raised SaveError (fail campaigns)
    open_uploads: int = 0  # multipart uploads a killed client left open (the next owner aborts them)
    late: int = 0
    check_s: float = 0.0  # time spent checking (overlaps the next child's run)
    violations: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Campaign:
    zygote: Zygote
    store: Store
    proxy: Any  # tests.helpers.s3.FaultProxy
    template: str  # store prefix holding the baseline
    local_template: Path | None  # tiered: the local root of the baseline run
    scratch: Path
    plan: list[Save]
    patches: tuple[str, ...] = ()
    shape: tuple[int, int] = SHAPE

    @property
    def tiered(self) -> bool:
        return self.local_template is not None

    def new_case(self, name: str) -> tuple[str, Path | None]:
        prefix = f"{name}-{uuid.uuid4().hex[:8]}"
        self.store.copy(self.template, prefix)
        local = None
        if self.local_template is not None:
            local = self.scratch / prefix
            shutil.copytree(self.local_template, local, symlinks=True)
        return prefix, local

    def cmd(self, prefix: str, local: Path | None, session: dict[str, Any], out: Path) -> dict[str, Any]:
        args: dict[str, Any] = {
            "url": self.store.url(prefix),
            "proxy": self.store.via(self.proxy.endpoint),
            "case": prefix,
            "session": session,
            "plan": [list(s) for s in self.plan],
            "local_root": str(local) if local is not None else None,
        }
        args["patches"] = list(self.patches)
        args["shape"] = list(self.shape)
        args["scheme"] = self.store.scheme
        return {"scenario": "objstore", "args": args, "out": str(out)}

    def count(self) -> list[dict[str, Any]]:
        prefix, local = self.new_case("count")
        out = self.scratch / f"{prefix}.json"
        code = self.zygote.run(self.cmd(prefix, local, {"mode": "count"}, out), timeout=180)
        assert code == 0, (out.read_text() if out.exists() else "", self.zygote.log_tail())
        ops = self.proxy.sessions[prefix].ops
        self.cleanup(prefix, local)
        return ops

    def cleanup(self, prefix: str, local: Path | None) -> None:
        self.store.delete(prefix)
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)
        self.proxy.sessions.pop(prefix, None)

    def expect(self, prefix: str) -> Expect:
        events = self.proxy.sessions[prefix].events
        return expect_from(events, f"/{self.store.bucket}/{prefix}", BASELINE, fixed=self.tiered)

    def check(self, prefix: str, local: Path | None, exp: Expect) -> list[str]:
        if local is not None:
            return check_tiered(self.store, prefix, local, exp, exp.listed, self.shape)
        return check_store(self.store, prefix, exp, exp.listed, self.shape)

    def crash(self, points: list[int] | None, when: str, ops: list[dict[str, Any]]) -> Result:
        """SIGKILL the child at each chosen mutation (every one by default), ``when`` the store has or has
        not applied it."""
        result = Result(ops=len(ops))
        chosen = points if points is not None else [op["i"] for op in ops]
        kinds = {op["i"]: op["op"] for op in ops}

        def check(k: int, prefix: str, local: Path | None, out: Path, code: int) -> None:
            where = f"k={k} ({kinds.get(k)} {when})"
            session = self.proxy.sessions[prefix]
            crashed = [e for e in session.events if e["ev"] == "crash"]
            if code != -9 or not crashed:
                result.violations.append(f"{where}: the child did not crash there (exit {code}): {_out(out)}")
                self.cleanup(prefix, local)
                return
            op = next(e for e in session.ops if e["i"] == k)
            where = f"k={k} ({op['op']} {op['key'].split(prefix, 1)[-1]} {when})"
            if op["op"] != kinds.get(k):
                result.violations.append(
                    f"{where} [trace]: the clean run's mutation {k} was a {kinds.get(k)}"
                )
            result.kinds[op["op"]] = result.kinds.get(op["op"], 0) + 1
            exp = self.expect(prefix)
            result.late += exp.late
            result.open_uploads += self.store.open_uploads(prefix)
            t0 = time.monotonic()
            result.violations += [f"{where}: {p}" for p in self.check(prefix, local, exp)]
            result.check_s += time.monotonic() - t0
            result.points += 1
            self.cleanup(prefix, local)

        def cases() -> Iterator[tuple[dict[str, Any], Callable[[int], None]]]:
            for k in chosen:
                prefix, local = self.new_case(f"k{k}{when[0]}")
                out = self.scratch / f"{prefix}.json"
                session = {"mode": "crash", "at": k, "when": when}
                yield self.cmd(prefix, local, session, out), functools.partial(check, k, prefix, local, out)

        checks.pipelined(self.zygote, cases(), timeout=180)
        return result

    def fail(self, targets: list[tuple[int, dict[str, Any]]], ops: list[dict[str, Any]]) -> Result:
        """Fail (or lose the answer of) each chosen mutation. Invariants: the child neither dies nor hangs;
        a save that raised SaveError left the store's listing as it was (nothing committed) or, for a
        re-save interrupted after the old copy's manifest was deleted, holds the new copy staged for the
        next owner; a save that returned is listed (tiered: durable); the saves after it work (training
        goes on); the final store passes every check of a crash (listing, restore, cleanup)."""
        result = Result(ops=len(ops))
        kinds = {op["i"]: op["op"] for op in ops}

        def check(
            k: int, fault: dict[str, Any], prefix: str, local: Path | None, out: Path, code: int
        ) -> None:
            name = fault["error"] if fault["mode"] == "fail" else "lost answer"
            sticky = " until the store is back" if fault.get("sticky") else ""
            where = f"{name}{sticky} at k={k} ({kinds.get(k)})"
            bad = result.violations.append
            data = json.loads(out.read_text()) if out.exists() else {}
            session = self.proxy.sessions[prefix]
            result.points += 1
            result.kinds[kinds.get(k, "?")] = result.kinds.get(kinds.get(k, "?"), 0) + 1
            if code != 0 or not data.get("ok"):
                bad(f"{where} [child]: exited {code}: {data.get('exception')}: {data.get('message')}")
                self.cleanup(prefix, local)
                return
            if not any(e["ev"] in ("fail", "lost") for e in session.events):
                bad(f"{where} [child]: the fault was never reached")
            outcomes = data["outcomes"]
            failed = [o for o in outcomes if not o["ok"]]
            result.failed_saves += len(failed)
            if fault["mode"] == "lost" and failed:
                bad(f"{where} [retry]: a lost answer made a save fail: {failed[0]['error']}")
            if fault.get("error") == "503" and not fault.get("sticky") and failed:
                bad(f"{where} [retry]: one 503 (retried) made a save fail: {failed[0]['error']}")
            for o in outcomes:
                save = (o["step"], o["version"])
                before = {int(s): v for s, v in o["before"].items()}
                after = {int(s): v for s, v in o["after"].items()}
                if o["torn"]:
                    bad(f"{where} [torn]: after save {save}, listed but incomplete: {o['torn']}")
                if o["ok"]:
                    if after.get(save[0]) != save[1]:
                        bad(f"{where} [lie]: save {save} returned but the store lists {after}")
                    continue
                if not self.tiered and "not committed" not in o["error"]:
                    bad(f"{where} [cause]: the error does not say so: {o['error']}")
                if not any(c in o["error"] for c in store_errors.NAMES[self.store.scheme][fault["error"]]):
                    bad(f"{where} [cause]: the error does not name the store's error: {o['error']}")
                if "\n" in o["error"]:
                    bad(f"{where} [cause]: the error is not one line: {o['error']!r}")
                changed = {s: v for s, v in after.items() if before.get(s) != v}
                if changed:
                    bad(f"{where} [lie]: save {save} raised, yet the store newly lists {changed}")
                lost = {s: v for s, v in before.items() if s not in after}
                if (
                    lost
                    and not self.tiered
                    and not _rolled_forward(self.store, prefix, save, lost, outcomes, o)
                ):
                    bad(f"{where} [lost]: save {save} raised and the store no longer lists {lost}")
            later = outcomes[outcomes.index(failed[0]) + 1 :] if failed else []
            for o in later:
                if not o["ok"]:
                    bad(f"{where} [continue]: training could not go on: {o['error']}")
            exp = self.expect(prefix)
            final = {int(s): v for s, v in outcomes[-1]["after"].items()}
            result.violations += [
                f"{where} [final]: {p}" for p in self.check(prefix, local, _final(exp, final))
            ]
            self.cleanup(prefix, local)

        def cases() -> Iterator[tuple[dict[str, Any], Callable[[int], None]]]:
            for k, fault in targets:
                prefix, local = self.new_case(f"f{k}")
                out = self.scratch / f"{prefix}.json"
                session = {"at": k, **fault}
                yield (
                    self.cmd(prefix, local, session, out),
                    functools.partial(check, k, fault, prefix, local, out),
                )

        checks.pipelined(self.zygote, cases(), timeout=180)
        return result


def _rolled_forward(
    store: Store,
    prefix: str,
    save: Save,
    lost: dict[int, int],
    outcomes: list[dict[str, Any]],
    o: dict[str, Any],
) -> bool:
    """The one window the protocol has: a re-save that failed after the old copy's manifest was deleted.
    Allowed only if the error says so and the new copy (complete, staged) is promoted by the next save
    (or, if there is none, is still staged for the next owner)."""
    if list(lost) != [save[0]] or "finishes the replacement" not in o["error"]:
        return False
    n = outcomes.index(o)
    if n + 1 < len(outcomes):
        return bool(outcomes[n + 1]["after"].get(str(save[0])) == save[1])
    pattern = rf"\.pending/step-{save[0]}-\w+/safepoint\.json$"
    return any(re.match(pattern, k) for k in store.keys(prefix))


def _final(exp: Expect, listed: dict[int, int]) -> Expect:
    # After a fault the child went on: the final listing is what it saw last (no crash to replay).
    return dataclasses.replace(exp, listed=listed)


def _out(out: Path) -> str:
    if not out.exists():
        return ""
    data = json.loads(out.read_text())
    return f"{data.get('exception')}: {data.get('message')}"
