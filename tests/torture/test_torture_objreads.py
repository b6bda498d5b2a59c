"""Fail every read request (GET, HEAD, LIST) of a restore, a save with retention, a lease check and the
``verify`` CLI on an object store, one at a time: tests/torture/objreads.py has the jobs, the layer (the
mutation campaign's proxy, counting reads) and the checks (a)-(d).

The default run takes a handful of reads on s3:// (a listing, a HEAD, a GET of each job part; the faults
that exposed the bugs fixed since). ``-m slow`` takes every read of every job on s3:// and gs://, each
failed with a ``503`` until the store is back, a reset and a cut body; every listing answered short; a slow
answer at the first read of each kind (s3://); and checks that the campaign catches each fixed bug.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.s3 import new_bucket, running_proxy
from tests.helpers.stores import gcs_store
from tests.torture import checks, objstore
from tests.torture.harness import Zygote, shared_zygote
from tests.torture.objreads import JOBS, ReadCampaign, Result
from tests.torture.objstore import Campaign, FsStore, Store

Fault = dict[str, Any]
STORE_DOWN: Fault = {"error": "503", "sticky": True}


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Zygote:
    return shared_zygote(tmp_path_factory.getbasetemp())


def _campaign(request: pytest.FixtureRequest, zygote: Zygote, scheme: str) -> Iterator[ReadCampaign]:
    if scheme == "gs":
        endpoint = request.getfixturevalue("gcs_endpoint")
        store: Store = FsStore("gs", endpoint, gcs_store(endpoint).make_bucket())
    else:
        endpoint = request.getfixturevalue("moto_endpoint")
        store = Store(endpoint, new_bucket(endpoint))
    with running_proxy(endpoint) as proxy, checks.fast_dir(f"objreads-{scheme}") as scratch:
        template = f"template-reads-{scheme}"
        objstore.make_baseline(store, template, None, objstore.SMALL)
        yield ReadCampaign(Campaign(zygote, store, proxy, template, None, scratch, [], shape=objstore.SMALL))


@pytest.fixture(scope="module")
def s3(request: pytest.FixtureRequest, zygote: Zygote) -> Iterator[ReadCampaign]:
    yield from _campaign(request, zygote, "s3")


@pytest.fixture(scope="module", params=["s3", "gs"])
def any_store(request: pytest.FixtureRequest, zygote: Zygote) -> Iterator[ReadCampaign]:
    yield from _campaign(request, zygote, request.param)


def _clean(c: ReadCampaign, job: str, targets: list[tuple[int, Fault]], label: str) -> Result:
    r = c.fail(job, targets, c.reads(job))
    checks.record_figures(
        label, points=r.points, reads=r.reads, kinds=r.kinds, fallbacks=r.fallbacks, failed=r.failed,
        violations=len(r.violations),
    )  # fmt: skip
    assert r.points == len(targets)
    assert not r.violations, "\n".join(r.violations)
    return r


# ---- default: a handful of reads -------------------------------------------------------------------------


def test_restore_read_faults_short(s3: ReadCampaign) -> None:
    """The restore job (open, clean up, discover, verify, load; then a save): the store down from the
    cleanup's listing on (after the lease was taken: the start fails in one line, and the next manager of
    this process opens: a bug this found); that listing cut short (the cleanup deleted committed step 1: a
    bug this found); a data object's HEAD answered 503 and its GET cut short (retried: restored exactly)."""
    targets = [
        (s3.find("restore", "list", "", 1), STORE_DOWN),
        (s3.find("restore", "list", "", 1), {"error": "short"}),
        (s3.find("restore", "head", "/step-2/__0_0.distcp"), {"error": "503"}),
        (s3.find("restore", "get", "/step-2/__0_0.distcp"), {"error": "truncate"}),
    ]
    _clean(s3, "restore", targets, "objreads-restore-short")


def test_save_read_faults_short(s3: ReadCampaign) -> None:
    """The save job (a save whose retention deletes step 1, then another): the lease unreadable from
    retention's fence on (retention stopped for good: a bug this found)."""
    _clean(s3, "save", [(_retention_fence(s3), STORE_DOWN)], "objreads-save-short")


def _retention_fence(c: ReadCampaign) -> int:
    """The read of the lease by retention's fence before its first delete: the save job reads the lease at
    the manager's start, at the commit's fence, then there."""
    return [e["j"] for e in c.reads("save") if e["key"].split("?")[0].endswith("/.lease")][2]


# ---- slow: every read ------------------------------------------------------------------------------------


def _every(c: ReadCampaign, job: str) -> list[tuple[int, Fault]]:
    targets: list[tuple[int, Fault]] = []
    first: set[str] = set()
    for e in c.reads(job):
        for fault in (STORE_DOWN, {"error": "reset"}, {"error": "truncate"}):
            if fault["error"] == "truncate" and e["op"] == "head":
                continue  # (a HEAD has no body to cut: the same as a reset)
            targets.append((e["j"], fault))
        if e["op"] == "list":
            targets.append((e["j"], {"error": "short"}))
        if e["op"] not in first and c.base.store.scheme == "s3":  # (the read timeout is set on s3:// only)
            first.add(e["op"])
            targets.append((e["j"], {"error": "slow"}))
    return targets


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("job", JOBS)
def test_read_faults_every_k(any_store: ReadCampaign, job: str) -> None:
    _clean(any_store, job, _every(any_store, job), f"objreads-{job}-every-k")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_read_campaign_catches_each_fixed_bug(s3: ReadCampaign) -> None:
    """Each bug this campaign found, put back in the children (objreads.put_back): caught."""
    cases = {
        "cleanup_trusts_the_listing": ("restore", s3.find("restore", "list", "", 1), {"error": "short"}),
        "unreadable_lease_stops_retention": ("save", _retention_fence(s3), STORE_DOWN),
        "released_lease_blocks_this_process": ("restore", s3.find("restore", "list", "", 1), STORE_DOWN),
    }
    for bug, (job, k, fault) in cases.items():
        broken = ReadCampaign(s3.base, patches=(bug,), counted=s3.counted)
        r = broken.fail(job, [(k, fault)], s3.reads(job))
        assert r.violations, f"{bug} put back: not caught"
