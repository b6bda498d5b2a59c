"""Crash and fail every object-store mutation of a save, a retention pass and an upload.

tests/torture/objstore.py has the layer (a counting, fault-injecting HTTP proxy in front of moto's server,
real s3fs in the children) and the invariants. Two workloads, each over a root that holds two committed
checkpoints (steps 1, 2; keep_last=2), every data file a two-part multipart upload:

    direct  an ``s3://`` root: save step 3 (retention deletes step 1), save step 3 again (staged under
            .pending, the old manifest deleted, copied over, the new manifest written), save step 4
            (retention deletes step 2)
    tiered  local_root + s3:// root: save steps 3 and 4 locally, each uploaded (durable retention deletes
            steps 1 and 2) before the next

The model has a frozen tensor besides the trained ones (objstore.FrozenModel): the baseline's step 2 holds it
in a stable group, so each save of a plan copies that group server-side (an S3 CopyObject, a GCS rewrite,
an Azure Copy Blob; remote/incremental_copy.py, and the tiered uploads' copies), and those copies are
crash points like any other mutation.

A clean run counts the mutations; then one child per mutation k is SIGKILLed just before the store sees it
(``before``) or just after the store applied it (``after``: the answer never arrives), or k fails with
503 SlowDown until the store is back, or with one 403 AccessDenied, or (a batch delete) is answered 200
with every key failed, or is applied and its answer lost.

The default run takes a handful of k with a small model (every object one PUT): the commit point, the
delete points and the re-save's window, and the faults that exposed the bugs fixed since. ``-m slow``
takes every k, both ways, and every fault, with multipart uploads, and checks that the campaign catches
mutations of the protocol (manifest first, data deleted before the manifest, a re-save in place or copied
before it is unlisted) and each fixed bug, put back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from safepoint.store.incremental import is_stable_group
from tests.helpers.s3 import FaultProxy, new_bucket, running_proxy
from tests.helpers.stores import azure_store, gcs_store
from tests.torture import checks, objstore
from tests.torture.harness import Zygote, shared_zygote
from tests.torture.objstore import Campaign, FsStore, Result, Store

KINDS = {"put", "part", "copy", "mpu-create", "mpu-complete", "delete-batch"}


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Zygote:
    return shared_zygote(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def env(moto_endpoint: str) -> Iterator[tuple[Store, FaultProxy, Path]]:
    with running_proxy(moto_endpoint) as proxy, checks.fast_dir("objstore") as scratch:
        yield Store(moto_endpoint, new_bucket(moto_endpoint)), proxy, scratch


@pytest.fixture(scope="module", params=["gs", "az"])
def other_env(request: pytest.FixtureRequest) -> Iterator[tuple[Store, FaultProxy, Path]]:
    """GCS (fake-gcs-server) or Azure (Azurite) behind the same proxy: it counts their mutations too."""
    scheme = request.param
    if scheme == "gs":
        endpoint = request.getfixturevalue("gcs_endpoint")
        bucket = gcs_store(endpoint).make_bucket()
    else:
        endpoint = request.getfixturevalue("azurite_endpoint")
        bucket = azure_store(endpoint).make_bucket()
    with running_proxy(endpoint) as proxy, checks.fast_dir(f"objstore-{scheme}") as scratch:
        yield FsStore(scheme, endpoint, bucket), proxy, scratch


def _campaign(
    zygote: Zygote,
    env: tuple[Store, FaultProxy, Path],
    tiered: bool,
    shape: tuple[int, int] = objstore.SHAPE,
    **kw: Any,
) -> Campaign:
    store, proxy, scratch = env
    name = f"{'tiered' if tiered else 'direct'}-{shape[0]}-{'-'.join(kw.get('patches', ()))}"
    local = scratch / f"template-{name}-local" if tiered else None
    objstore.make_baseline(store, f"template-{name}", local, shape)
    plan = objstore.TIERED_PLAN if tiered else objstore.DIRECT_PLAN
    return Campaign(zygote, store, proxy, f"template-{name}", local, scratch, plan, shape=shape, **kw)


Ops = list[dict[str, Any]]


@pytest.fixture(scope="module")
def direct(zygote: Zygote, env: tuple[Store, FaultProxy, Path]) -> tuple[Campaign, Ops]:
    c = _campaign(zygote, env, tiered=False)
    return c, c.count()


@pytest.fixture(scope="module")
def tiered(zygote: Zygote, env: tuple[Store, FaultProxy, Path]) -> tuple[Campaign, Ops]:
    c = _campaign(zygote, env, tiered=True)
    return c, c.count()


# The short versions use a small model: every object is one PUT, so a case costs a third as much.
@pytest.fixture(scope="module")
def direct_small(zygote: Zygote, env: tuple[Store, FaultProxy, Path]) -> tuple[Campaign, Ops]:
    c = _campaign(zygote, env, tiered=False, shape=objstore.SMALL)
    return c, c.count()


@pytest.fixture(scope="module")
def tiered_small(zygote: Zygote, env: tuple[Store, FaultProxy, Path]) -> tuple[Campaign, Ops]:
    c = _campaign(zygote, env, tiered=True, shape=objstore.SMALL)
    return c, c.count()


def _find(ops: Ops, kind: str | tuple[str, ...], key: str, nth: int = 0) -> int:
    """The number of the ``nth`` mutation of ``kind`` whose key (or one of whose keys) ends with ``key``."""
    kinds = (kind,) if isinstance(kind, str) else kind
    found = [
        op["i"]
        for op in ops
        if op["op"] in kinds and any(k.endswith(key) for k in op.get("keys") or [op["key"]])
    ]
    assert len(found) > nth, f"no {kind} of {key} among {[(o['op'], o['key']) for o in ops]}"
    return found[nth]


def _fail_clean(c: Campaign, ops: Ops, targets: list[tuple[int, dict[str, Any]]], label: str) -> None:
    """Run the fault campaign at ``targets``, record its figures under ``label``: every target reached,
    no invariant violated."""
    r = c.fail(targets, ops)
    _record(label, r)
    assert r.points == len(targets)
    assert not r.violations, "\n".join(r.violations)


def _stable_copies(ops: Ops, where: str = "") -> list[int]:
    """The server-side copies of stable groups (the frozen tensor's, copied from the previous step instead
    of sent again) into a key containing ``where``."""
    return [
        op["i"]
        for op in ops
        if op["op"] == "copy" and where in op["key"] and is_stable_group(op["key"].rsplit("/", 1)[-1])
    ]


def _in_saves(ops: Ops) -> list[int]:
    """Every mutation but the lease's (its create before the saves, its delete at close)."""
    return [
        op["i"] for op in ops if not op["key"].endswith("/.lease") and "/.lease" not in str(op.get("keys"))
    ]


def _manifests(ops: list[dict[str, Any]]) -> list[int]:
    """The commit and delete points: every mutation of a manifest (PUT, DELETE, batch delete with one)."""
    out = []
    for op in ops:
        keys = op.get("keys") or [op["key"]]
        if any(k.endswith("/safepoint.json") for k in keys):
            out.append(op["i"])
    return out


def _one_of_each(ops: list[dict[str, Any]]) -> list[int]:
    seen: dict[str, int] = {}
    for op in ops:
        seen.setdefault(op["op"], op["i"])
    return sorted(seen.values())


def _record(name: str, r: Result) -> None:
    checks.record_figures(
        name,
        points=r.points,
        ops=r.ops,
        kinds=r.kinds,
        failed_saves=r.failed_saves,
        open_uploads=r.open_uploads,
        violations=len(r.violations),
    )


# ---- default: a handful of k ------------------------------------------------------------------------------


def test_direct_crash_short(direct_small: tuple[Campaign, Ops]) -> None:
    """The commit point and the re-save's window (old manifest deleted, new one not written yet), SIGKILLed
    just before; the server-side copy of the frozen tensor's stable group into step 3, and retention's and
    the re-save's manifest deletes, SIGKILLed just after the store applied them."""
    c, ops = direct_small
    before = [_find(ops, "put", "/step-3/safepoint.json"), _find(ops, "copy", "/step-3/__0_0.distcp")]
    after = [
        _stable_copies(ops, "/step-3/")[0],
        _find(ops, "delete-batch", "/step-1/safepoint.json"),
        _find(ops, "delete-batch", "/step-3/safepoint.json"),
    ]
    r = c.crash(before, "before", ops)
    r2 = c.crash(after, "after", ops)
    _record("objstore-direct-crash-short", r)
    _record("objstore-direct-crash-after-short", r2)
    assert (r.points, r2.points) == (len(before), len(after))
    assert not r.violations + r2.violations, "\n".join(r.violations + r2.violations)


def test_tiered_crash_short(tiered_small: tuple[Campaign, Ops]) -> None:
    c, ops = tiered_small
    points = [_find(ops, "put", "/step-3/safepoint.json")]
    r = c.crash(points, "before", ops)
    _record("objstore-tiered-crash-short", r)
    assert r.points == len(points)
    assert not r.violations, "\n".join(r.violations)


def test_direct_faults_short(direct_small: tuple[Campaign, Ops]) -> None:
    """One 403 in the re-save's window: the step it replaces must not be lost (a bug this found: the staged
    copy was discarded after the old manifest was gone); 503 until the store is back at retention's
    manifest delete: the save that committed must not raise (a bug this found: UploadError escaped the
    retention pass); a batch delete answered 200 with the manifest's key failed, twice: the step must not
    stay listed over deleted data (a bug this found: s3fs's rm ignores per-key errors)."""
    c, ops = direct_small
    targets = [
        (_find(ops, "copy", "/step-3/__0_0.distcp"), {"mode": "fail", "error": "403"}),
        (
            _find(ops, "delete-batch", "/step-1/safepoint.json"),
            {"mode": "fail", "error": "503", "sticky": True},
        ),
        (
            _find(ops, "delete-batch", "/step-1/safepoint.json"),
            {"mode": "fail", "error": "key-errors", "count": 2},
        ),
    ]
    _fail_clean(c, ops, targets, "objstore-direct-faults-short")


# ---- GCS and Azure: the short crash campaigns, and answers lost ------------------------------------------


@pytest.fixture(scope="module")
def other_direct(zygote: Zygote, other_env: tuple[Store, FaultProxy, Path]) -> tuple[Campaign, Ops]:
    c = _campaign(zygote, other_env, tiered=False, shape=objstore.SMALL)
    return c, c.count()


_DELETES = ("delete", "delete-batch")


def test_other_stores_direct_crash_short(other_direct: tuple[Campaign, Ops]) -> None:
    """On gs:// and az://: SIGKILL just before the commit point (the manifest's write), and just after the
    store applied retention's manifest delete (the step is unlisted, its data not deleted yet)."""
    c, ops = other_direct
    r = c.crash([_find(ops, "put", "/step-3/safepoint.json")], "before", ops)
    r2 = c.crash([_find(ops, _DELETES, "/step-1/safepoint.json")], "after", ops)
    _record(f"objstore-{c.store.scheme}-direct-crash-short", r)
    _record(f"objstore-{c.store.scheme}-direct-crash-after-short", r2)
    assert (r.points, r2.points) == (1, 1)
    assert not r.violations + r2.violations, "\n".join(r.violations + r2.violations)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_other_stores_resave_window(other_direct: tuple[Campaign, Ops]) -> None:
    """The re-save's window on gs:// and az://: SIGKILL just before a copy over the unlisted step, and just
    after the store applied the delete of the old copy's manifest; and the server-side copies of the frozen
    tensor's stable group (GCS rewrite, Azure Copy Blob) into step 3 and into the re-save's staged copy,
    just after the store applied them."""
    c, ops = other_direct
    r = c.crash([_find(ops, "copy", "/step-3/__0_0.distcp")], "before", ops)
    copies = [_stable_copies(ops, "/step-3/")[0], _stable_copies(ops, "/.pending/step-3-")[0]]
    r2 = c.crash([_find(ops, _DELETES, "/step-3/safepoint.json"), *copies], "after", ops)
    _record(f"objstore-{c.store.scheme}-resave-window", r)
    assert (r.points, r2.points) == (1, 3)
    assert not r.violations + r2.violations, "\n".join(r.violations + r2.violations)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_other_stores_lost_answers_short(other_direct: tuple[Campaign, Ops]) -> None:
    """On gs:// and az://, the store applies a request and the answer never arrives (the proxy resets the
    connection), so the client library retries it: at the commit point, inside the re-save's window, and
    at retention's manifest delete. No save may fail for it, and the store must end as a clean run does."""
    c, ops = other_direct
    lost = {"mode": "lost"}
    targets = [
        (_find(ops, "put", "/step-3/safepoint.json"), lost),
        (_find(ops, "copy", "/step-3/__0_0.distcp"), lost),
        (_find(ops, _DELETES, "/step-1/safepoint.json"), lost),
    ]
    _fail_clean(c, ops, targets, f"objstore-{c.store.scheme}-direct-lost-short")


# Behind -m slow (with test_other_stores_faults_every_k) to keep the default suite under its time bar:
# S3's test_direct_faults_short runs the same commit-point and re-save-window paths by default.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_other_stores_faults_short(other_direct: tuple[Campaign, Ops]) -> None:
    """Error replies in gs://'s and az://'s own words (tests/helpers/store_errors.py): one 503 at the commit
    point (the manifest's write) is retried and the save succeeds; a 403 that persists until the save gives
    up, in the re-save's window (a copy over the unlisted step), fails that save with a one-line error
    naming the store's, loses no step, and the next save works."""
    c, ops = other_direct
    targets = [
        (_find(ops, "put", "/step-3/safepoint.json"), {"mode": "fail", "error": "503"}),
        (_find(ops, "copy", "/step-3/__0_0.distcp"), {"mode": "fail", "error": "403", "sticky": True}),
    ]
    _fail_clean(c, ops, targets, f"objstore-{c.store.scheme}-direct-faults-short")


OTHER_FAULTS: dict[str, dict[str, Any]] = {
    "503-once": {"mode": "fail", "error": "503"},
    "503-until-back": {"mode": "fail", "error": "503", "sticky": True},
    "403-until-back": {"mode": "fail", "error": "403", "sticky": True},
}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("fault", sorted(OTHER_FAULTS))
def test_other_stores_faults_every_k(other_direct: tuple[Campaign, Ops], fault: str) -> None:
    """Each error reply, in GCS's or Azure's words, at every mutation of the direct saves on gs:// and
    az://: one 503 never fails a save; a 503 or 403 that lasts until the save gives up fails it cleanly."""
    c, ops = other_direct
    targets = [(k, OTHER_FAULTS[fault]) for k in _in_saves(ops)]
    _fail_clean(c, ops, targets, f"objstore-{c.store.scheme}-direct-faults-{fault}")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_other_stores_direct_crash_every_k(other_direct: tuple[Campaign, Ops]) -> None:
    """Every mutation of the direct workload on gs:// and az://, SIGKILLed just before the store sees it."""
    c, ops = other_direct
    # The frozen group copied from the previous step into steps 3, 3 again (staged), 4; and the re-save's
    # promotion copying it with the rest of the staged step.
    assert len(_stable_copies(ops)) == 4
    r = c.crash(None, "before", ops)
    _record(f"objstore-{c.store.scheme}-direct-crash-before", r)
    assert r.points == len(ops)
    assert not r.violations, "\n".join(r.violations)


@pytest.fixture(scope="module")
def other_tiered(zygote: Zygote, other_env: tuple[Store, FaultProxy, Path]) -> tuple[Campaign, Ops]:
    c = _campaign(zygote, other_env, tiered=True, shape=objstore.SMALL)
    return c, c.count()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_other_stores_tiered_crash_every_k(other_tiered: tuple[Campaign, Ops]) -> None:
    """Every mutation of the tiered workload (uploads, durable retention) on gs:// and az://."""
    c, ops = other_tiered
    assert len(_stable_copies(ops)) == 2  # the uploads of steps 3 and 4 copied the frozen group
    r = c.crash(None, "before", ops)
    _record(f"objstore-{c.store.scheme}-tiered-crash-before", r)
    assert r.points == len(ops)
    assert not r.violations, "\n".join(r.violations)


# ---- slow: every k -----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("when", ["before", "after"])
def test_direct_crash_every_k(direct: tuple[Campaign, Ops], when: str) -> None:
    c, ops = direct
    # The frozen group copied from the previous step into steps 3, 3 again (staged), 4; and the re-save's
    # promotion copying it with the rest of the staged step.
    assert len(_stable_copies(ops)) == 4
    r = c.crash(None, when, ops)
    _record(f"objstore-direct-crash-{when}", r)
    assert r.points == r.ops == len(ops)
    assert set(r.kinds) >= KINDS
    assert not r.violations, "\n".join(r.violations)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("when", ["before", "after"])
def test_tiered_crash_every_k(tiered: tuple[Campaign, Ops], when: str) -> None:
    c, ops = tiered
    assert len(_stable_copies(ops)) == 2  # the uploads of steps 3 and 4 copied the frozen group
    r = c.crash(None, when, ops)
    _record(f"objstore-tiered-crash-{when}", r)
    assert r.points == r.ops == len(ops)
    assert not r.violations, "\n".join(r.violations)


FAULTS: dict[str, dict[str, Any]] = {
    "503-until-back": {"mode": "fail", "error": "503", "sticky": True},
    "403-once": {"mode": "fail", "error": "403"},
    "answer-lost": {"mode": "lost"},
}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_direct_faults_every_k(direct: tuple[Campaign, Ops], fault: str) -> None:
    c, ops = direct
    targets = [(k, FAULTS[fault]) for k in _in_saves(ops)]
    _fail_clean(c, ops, targets, f"objstore-direct-faults-{fault}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_direct_batch_delete_key_errors_every_k(direct: tuple[Campaign, Ops]) -> None:
    """Every batch delete answered 200 with its keys failed, twice in a row (then the store recovers)."""
    c, ops = direct
    fault = {"mode": "fail", "error": "key-errors", "count": 2}
    targets = [(op["i"], fault) for op in ops if op["op"] == "delete-batch" and op["i"] in _in_saves(ops)]
    assert len(targets) >= 8
    _fail_clean(c, ops, targets, "objstore-direct-faults-key-errors")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tiered_faults_every_k(tiered: tuple[Campaign, Ops]) -> None:
    c, ops = tiered
    targets = [(k, FAULTS["503-until-back"]) for k in _in_saves(ops)]
    _fail_clean(c, ops, targets, "objstore-tiered-faults-503-until-back")


# Each mutation breaks the store protocol in the child; the crash campaign over the saves it affects must
# notice every one: (tiered?, the first and last mutation of the window it is crashed in).
MUTATIONS: dict[str, tuple[bool, tuple[str, str], tuple[str, str]]] = {
    # the upload sends the manifest first: a crash before the data is up leaves a listed, torn step
    "manifest_first": (True, ("put", "/step-3/safepoint.json"), ("mpu-complete", "/step-3/__0_0.distcp")),
    # retention deletes the data, then the manifest: a crash in between leaves a listed, torn step
    "delete_data_first": (
        False,
        ("put", "/step-3/safepoint.json"),
        ("delete-batch", "/step-1/safepoint.json"),
    ),
    # a re-save overwrites the committed step in place: a crash midway tears it
    "resave_in_place": (
        False,
        ("mpu-create", "/step-3/__0_0.distcp", 1),
        ("put", "/step-3/safepoint.json", 1),
    ),
    # a re-save copies over step N before unlisting it: a crash midway leaves a listed, mixed step
    "copy_before_unlisting": (False, ("copy", "/step-3/.metadata", 1), ("put", "/step-3/safepoint.json", 1)),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_campaign_catches_each_mutation(
    zygote: Zygote, env: tuple[Store, FaultProxy, Path], mutation: str
) -> None:
    tiered, first, last = MUTATIONS[mutation]
    c = _campaign(zygote, env, tiered=tiered, patches=(mutation,))
    ops = c.count()
    lo, hi = _find(ops, *first), _find(ops, *last)  # type: ignore[arg-type]
    r = c.crash([op["i"] for op in ops if min(lo, hi) <= op["i"] <= max(lo, hi)], "before", ops)
    assert r.violations, f"the campaign did not notice {mutation}"


# Bugs this campaign found, put back one at a time: the fault that exposed each must be caught again.
# (kind, key) of the mutation faulted, the fault, the model (SMALL: every object one PUT; SHAPE: multipart).
FAULT_MUTATIONS: dict[str, tuple[str, str, dict[str, Any], tuple[int, int]]] = {
    # one 403 in the re-save's promotion: the staged copy was deleted, the step was lost
    "promotion_discards_staged": (
        "copy",
        "/step-3/__0_0.distcp",
        {"mode": "fail", "error": "403"},
        objstore.SMALL,
    ),
    # the store down at retention's manifest delete: the committed save raised SaveError
    "retention_raises_upload_error": (
        "delete-batch",
        "/step-1/safepoint.json",
        {"mode": "fail", "error": "503", "sticky": True},
        objstore.SMALL,
    ),
    # a batch delete answered 200 with the manifest's key failed: the manifest stayed, the data went (the
    # next batch), a torn step was listed. Once: retention deletes the manifest once, then the data (when
    # remove deleted the manifest a second time, twice in a row was what reached the data)
    "bulk_delete_ignores_errors": (
        "delete-batch",
        "/step-1/safepoint.json",
        {"mode": "fail", "error": "key-errors"},
        objstore.SMALL,
    ),
    # a 403 on a multipart upload's create, inside DCP's write: reported as torch's "unexpected pos"
    "stream_error_not_oserror": (
        "mpu-create",
        "/step-3/__0_0.distcp",
        {"mode": "fail", "error": "403"},
        objstore.SHAPE,
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mutation", sorted(FAULT_MUTATIONS))
def test_the_fault_campaign_catches_each_fixed_bug(
    zygote: Zygote, env: tuple[Store, FaultProxy, Path], mutation: str
) -> None:
    kind, key, fault, shape = FAULT_MUTATIONS[mutation]
    for patches in ((mutation,), ()):
        c = _campaign(zygote, env, tiered=False, shape=shape, patches=patches)
        ops = c.count()
        r = c.fail([(_find(ops, kind, key), fault)], ops)
        if patches:
            assert r.violations, f"the campaign did not notice {mutation}"
        else:
            assert not r.violations, "\n".join(r.violations)
