"""The object-store lease under faults (remote/object_lease.py): its heartbeat failing, answered late or
never, a takeover racing a slow renewal, and a lease record that is garbage. The promise under test: only
the lease holder commits or deletes; two processes never both hold the lease.

Real stores (moto, fake-gcs-server, Azurite where it is installed) behind the fault proxy
(tests/helpers/s3.py: it answers in each store's own words, resets, holds a request, or applies it and
loses the answer). The holder H is a lease in this process, reaching the store through the proxy; the
contender C is another process on another host (a UTS namespace of its own, hostname ``nodeB``: on this
host a live pid is never taken over), talking to the store directly. Sequenced by the proxy's hold and by
pipes; the only waits are for the lease to age past ``lease_stale_after_s``, which is the behaviour.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import safepoint
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.object_lease import RemoteLease
from safepoint.remote.retry import TransferOptions
from safepoint.store.heartbeat import MAX_LEASE_BYTES
from tests.helpers.example_runs import PipedJob
from tests.helpers.s3 import FaultProxy, running_proxy
from tests.helpers.stores import Store
from tests.helpers.tcpproxy import proxied
from tests.store.test_fencing import _line, needs_second_host

# The cases that wait out leases run on S3 by default, on GCS and Azure under -m slow (on all three they
# cost the default run ~70-100 s of wall time); the hostile records run on all three.
S3_BY_DEFAULT = pytest.mark.parametrize(
    "store",
    ["s3", pytest.param("gs", marks=pytest.mark.slow), pytest.param("az", marks=pytest.mark.slow)],
    indirect=True,
)

STALE = 2.0  # lease_stale_after_s: the heartbeat beats every 0.5 s
# Two tries per request, no backoff, no retries of the client library's own: a fault is seen at once.
FAST = TransferOptions(attempts=2, backoff_s=0.0, max_backoff_s=0.0, client_retries=0)
# The lease's writes as each store receives them (the tests here send no other write).
WRITES = {
    "s3": ("PUT", r"/\.lease(\?|$)"),
    "gs": ("POST", r"^/upload/storage/v1/b/"),
    "az": ("PUT", r"/\.lease(\?|$)"),
}

# The contender: polls until it takes the lease over (or, with "hook", until its takeover's conditional
# write was refused), says so, and holds the lease until told to finish. With "hook" it stops right
# before that write ("replacing") until the test says go: the test lines the holder's renewal up with it.
JOB_C = """
import json, sys, time
from safepoint.errors import LeaseError
from safepoint.remote.object_layout import RemoteLayout
from safepoint.remote.retry import TransferOptions
url, opts, stale, hook = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "hook"
fast = TransferOptions(attempts=2, backoff_s=0.0, max_backoff_s=0.0, client_retries=0)
lease = RemoteLayout(url, opts, transfer=fast).lease(stale)
tried = []
if hook:
    real = lease.obj.replace
    def replace(data, version):
        if not tried:
            tried.append(True)
            print("replacing", flush=True)
            sys.stdin.readline()
        return real(data, version)
    lease.obj.replace = replace
deadline = time.monotonic() + 60
while True:
    try:
        lease.acquire()
        print("took", lease.token, flush=True)
        break
    except LeaseError as e:
        if tried:
            print("refused:", e, flush=True)
            break
        assert time.monotonic() < deadline, f"never judged stale: {e}"
        time.sleep(0.05)
sys.stdin.readline()
lease.release()  # (only a lease still ours is removed)
"""


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _record(store: Store, url: str) -> dict[str, Any]:
    fs = store.fs()
    data: bytes = fs.cat_file(f"{url.split('://', 1)[1]}/.lease")
    rec: dict[str, Any] = json.loads(data)
    return rec


@pytest.fixture
def proxy(store: Store) -> Iterator[FaultProxy]:
    with running_proxy(store.endpoint) as fp:
        yield fp


def _holder(store: Store, proxy: FaultProxy, url: str, stale: float = STALE) -> RemoteLease:
    """H: the lease on ``url`` taken through the proxy, beating every ``stale / 4``."""
    lease = RemoteLayout(url, proxied(store, proxy).options, transfer=FAST).lease(stale)  # type: ignore[arg-type]
    assert isinstance(lease, RemoteLease)
    lease.acquire()
    return lease


def _contender(store: Store, url: str, hook: bool = False) -> PipedJob:
    return PipedJob(["-c", JOB_C, url, json.dumps(store.options), str(STALE), "hook" if hook else "-"],
                    hostname="nodeB")  # fmt: skip


def _finish(job: PipedJob) -> None:
    if job.poll() is None and job.stdin is not None:
        job.stdin.write("done\n")
        job.stdin.flush()
    job.wait(timeout=60)


# ---- (1) a renewal that fails, a few times or once, keeps the lease --------------------------------------


@S3_BY_DEFAULT
@pytest.mark.parametrize(
    ("fault", "times"),
    [("503", 1), ("503", 2), ("reset", 1), ("lost", 1)],
    ids=["503-once", "503-whole-beat", "reset", "lost-answer"],
)
def test_a_renewal_that_fails_for_less_than_the_limit_keeps_the_lease(
    store: Store, proxy: FaultProxy, fault: str, times: int
) -> None:
    """One failed try (retried within the beat), a whole beat failed (both tries: retried at the next
    beat), a reset connection, and a renewal the store applied whose answer was lost (its retry is
    refused by its condition, since the version changed: read back, it is our own write, and the lease is
    kept at its new version). Each time: the lease stays ours, later renewals land, commits go on."""
    url = store.root()
    lease = _holder(store, proxy, url)
    try:
        method, path = WRITES[store.scheme]
        rule = proxy.add(fault, method=method, path=path, count=times)
        _wait_for(lambda: rule.count == 0, "the fault")
        faulted = time.time()
        beats = lease.beats
        _wait_for(lambda: lease.beats >= beats + 3, "three more beats")
        assert lease.lost is None
        rec = _record(store, url)
        assert rec["token"] == lease.token
        assert rec["heartbeat"] > faulted, "no renewal landed after the fault"
        lease.fence("committing step 1")  # still the owner: no LeaseError
        if fault == "lost":
            writes = [what for m, p, what in proxy.seen if m == method]
            assert "lost" in writes and writes[-1] == "forward"
    finally:
        lease.release()
    assert ".lease" not in store.keys(url)


# ---- (1) renewals that keep failing: the holder stops before anyone may take over -------------------------


@S3_BY_DEFAULT
@needs_second_host
def test_a_holder_whose_renewals_keep_failing_stops_before_anyone_may_take_it_over(
    store: Store, proxy: FaultProxy
) -> None:
    """Every renewal answered 503 from some moment on (reads still work, so H still finds its own token
    on the store). Once its last landed renewal was sent half ``lease_stale_after_s`` ago, H's fence
    renews the lease itself, fails, and refuses with one line, while its lease is still on the store
    untouched: before any contender may judge it stale. It used to read its own token and commit,
    until the very moment a contender took over (and, frozen between that read and its write, after).
    Then C takes over once the lease is stale, and H names the new holder."""
    url = store.root()
    lease = _holder(store, proxy, url)
    c: PipedJob | None = None
    try:
        method, path = WRITES[store.scheme]
        proxy.add("503", method=method, path=path)
        refused: list[str] = []

        def fence_refuses() -> bool:
            try:
                lease.fence("committing step 2")
            except safepoint.LeaseError as e:
                refused.append(str(e))
                return True
            return False

        _wait_for(fence_refuses, "the fence to refuse")
        msg = refused[0]
        assert msg.startswith("not committing step 2: the lease was last renewed"), msg
        assert "renewing it now failed" in msg and "lease_stale_after_s" in msg, msg
        assert "\n" not in msg
        assert _record(store, url)["token"] == lease.token, "refused only after it was taken over"
        c = _contender(store, url)
        verdict = _line(c)
        assert verdict.startswith("took "), verdict
        with pytest.raises(safepoint.LeaseError, match="^not deleting step 1: ") as e:
            lease.fence("deleting step 1")
        assert "\n" not in str(e.value)
        _wait_for(lambda: lease.lost is not None, "the heartbeat to give up")
        proxy.clear()  # the store answers again: the lease is still lost, never taken back
        with pytest.raises(safepoint.LeaseError):
            lease.fence("committing step 2")
        assert _record(store, url)["token"] == verdict.split()[1]
    finally:
        lease.release()
        if c is not None:
            _finish(c)


@S3_BY_DEFAULT
def test_a_renewal_stuck_in_flight_makes_the_fence_refuse_within_a_beat(
    store: Store, proxy: FaultProxy
) -> None:
    """H's renewal hangs (the store never answers it). Past half the limit, the fence waits for that
    renewal a beat's time at most, then refuses in one line, rather than sending one of its own to hang
    beside it (renewals are one at a time). Once the store answers, nobody having taken over, the
    renewal lands and the fence passes again."""
    url = store.root()
    lease = _holder(store, proxy, url)
    try:
        method, path = WRITES[store.scheme]
        proxy.hold(method=method, path=path)
        assert proxy.held.wait(30), "H's renewal never came"
        refused: list[str] = []

        def fence() -> None:
            try:
                lease.fence("committing step 2")
            except safepoint.LeaseError as e:
                refused.append(str(e))

        deadline = time.monotonic() + 60
        while not refused:
            t = threading.Thread(target=fence, daemon=True)
            t.start()
            # A fence hung on the held renewal never returns before release: any bound tells it apart, and a
            # wide one leaves a loaded machine's slow read of the lease (the fence's _confirm) alone.
            t.join(30)
            assert not t.is_alive(), "the fence hung on the stuck renewal"
            assert time.monotonic() < deadline, "the fence never refused"
            time.sleep(0.02)
        assert refused[0].startswith("not committing step 2: a renewal of the lease has been in flight")
        assert "\n" not in refused[0]
        beats = lease.beats
        proxy.release.set()
        _wait_for(lambda: lease.beats >= beats + 2, "renewals to land again")
        assert lease.lost is None
        lease.fence("committing step 2")
        assert _record(store, url)["token"] == lease.token
    finally:
        proxy.release.set()
        lease.release()


# ---- (1, 3) a renewal held in the network past a takeover, and one racing it ------------------------------


@S3_BY_DEFAULT
@needs_second_host
@pytest.mark.parametrize("order", ["taker-first", "holder-first"])
def test_a_renewal_racing_a_takeover_leaves_exactly_one_holder(
    store: Store, proxy: FaultProxy, order: str
) -> None:
    """H's renewal is held in the network (a slow store: H's heartbeat is stuck on it) until C judges
    the lease stale and is about to replace it; then both writes go, each conditional on the version
    they read. ``taker-first``: C's write lands, then H's renewal arrives late, is refused, and H
    names C as the new holder (its fence refuses). ``holder-first``: H's renewal lands, C's write is
    refused and C, reading a fresh heartbeat, gives up. Either way exactly one holds the lease."""
    _race(store, proxy, order)


@needs_second_host
@pytest.mark.slow
@pytest.mark.parametrize("round_", range(10))
def test_a_renewal_and_a_takeover_sent_at_the_same_moment_leave_exactly_one_holder(
    store: Store, proxy: FaultProxy, round_: int
) -> None:
    """Both writes released together: whichever the store applies first wins; never both."""
    _race(store, proxy, "same-moment")


def _race(store: Store, proxy: FaultProxy, order: str) -> str:
    url = store.root()
    lease = _holder(store, proxy, url)
    c: PipedJob | None = None
    try:
        method, path = WRITES[store.scheme]
        proxy.hold(method=method, path=path)
        assert proxy.held.wait(30), "H's renewal never came"
        beats = lease.beats
        c = _contender(store, url, hook=True)
        assert _line(c) == "replacing"  # C judged the lease stale and is about to take it over
        assert c.stdin is not None
        if order == "holder-first":
            proxy.release.set()
            _wait_for(lambda: lease.beats > beats, "H's renewal to land")
        c.stdin.write("go\n")
        c.stdin.flush()
        if order == "same-moment":
            proxy.release.set()
        verdict = _line(c)
        proxy.release.set()
        _wait_for(lambda: lease.beats > beats, "H's renewal to come back")
        on_store = _record(store, url)["token"]
        if verdict.startswith("took "):
            assert order != "holder-first", verdict
            _wait_for(lambda: lease.lost is not None, "H to see the takeover")
            assert lease.lost is not None and "taken over by pid" in lease.lost and "nodeB" in lease.lost
            with pytest.raises(safepoint.LeaseError, match="nodeB"):
                lease.fence("committing step 2")
            assert on_store == verdict.split()[1]
        else:
            assert order != "taker-first", verdict
            assert verdict.startswith("refused: ") and "in use by" in verdict, verdict
            assert lease.lost is None
            lease.fence("committing step 2")
            assert on_store == lease.token
        return verdict
    finally:
        proxy.release.set()
        lease.release()
        if c is not None:
            _finish(c)


# ---- (4) a lease record that is garbage, huge or of the wrong types ---------------------------------------

HOSTILE = {
    "garbage": b"\x00\xffnot json{",
    "truncated": b'{"host": "a", "pid": 1, "tok',
    "array": b"[1, 2, 3]",
    "null": b"null",
    "empty": b"",
    "deep": b"[" * 5000,
    "huge": b'{"pad": "' + b"x" * (MAX_LEASE_BYTES * 40) + b'"}',
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_an_unreadable_lease_is_never_taken_over_while_young(store: Store, kind: str) -> None:
    """A lease object that is no lease record: one line naming it and what is wrong, never a traceback,
    and no takeover while it is younger than ``lease_stale_after_s`` (it may be a live holder's lease that
    someone overwrote). It used to be taken over at once, whatever its age. A huge one is not downloaded
    (only its first MAX_LEASE_BYTES + 1 bytes are asked for)."""
    url = store.root()
    store.fs().pipe_file(f"{url.split('://', 1)[1]}/.lease", HOSTILE[kind])
    with pytest.raises(safepoint.LeaseError) as e:
        safepoint.CheckpointManager(url, storage_options=store.options)
    msg = str(e.value)
    assert "\n" not in msg and "has a lease that cannot be read" in msg and "/.lease" in msg, msg
    assert "not taken over until it is older than 120s" in msg, msg
    if kind == "huge":
        assert f"larger than {MAX_LEASE_BYTES} bytes" in msg


def test_an_old_unreadable_lease_is_taken_over(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    url = store.root()
    store.fs().pipe_file(f"{url.split('://', 1)[1]}/.lease", b"garbage")
    cluster = safepoint.ClusterOptions(lease_stale_after_s=1.0)
    deadline = time.monotonic() + 30
    while True:
        try:
            mgr = safepoint.CheckpointManager(url, storage_options=store.options, cluster=cluster)
            break
        except safepoint.LeaseError as e:
            assert "cannot be read" in str(e)
            assert time.monotonic() < deadline, "never old enough"
            time.sleep(0.1)
    with mgr:
        assert "took over the stale lease of an unreadable lease file" in caplog.text
        mgr.save(1, safepoint.TrainState(rng=False, extra={"n": 1}))


def test_wrong_types_in_a_fresh_lease_name_the_holder_in_one_line(store: Store) -> None:
    url = store.root()
    rec = {"token": 5, "heartbeat": "x", "pid": "abc", "host": ["a"], "job": {"x": 1}}
    store.fs().pipe_file(f"{url.split('://', 1)[1]}/.lease", json.dumps(rec).encode())
    with pytest.raises(safepoint.LeaseError, match=r"in use by pid abc on host \['a'\] \(no job id") as e:
        safepoint.CheckpointManager(url, storage_options=store.options)
    assert "\n" not in str(e.value)


@S3_BY_DEFAULT
def test_a_live_holders_lease_overwritten_with_garbage_hands_the_root_to_nobody(
    store: Store, proxy: FaultProxy
) -> None:
    """Someone overwrites a live holder's lease with garbage: a contender is refused (it used to take the
    root over at once), and the holder, whose next renewal is refused by its condition, stops: nobody
    writes until the garbage is older than the limit."""
    url = store.root()
    lease = _holder(store, proxy, url)
    try:
        store.fs().pipe_file(f"{url.split('://', 1)[1]}/.lease", b"garbage")
        # C's limit is not the subject: at STALE (2 s) a C built more than 2 s after the overwrite (a loaded
        # machine: a new client, its first requests) would find the garbage old enough and take it over.
        other = RemoteLayout(url, store.options, transfer=FAST).lease(60.0)
        with pytest.raises(safepoint.LeaseError, match="has a lease that cannot be read"):
            other.acquire()
        _wait_for(lambda: lease.lost is not None, "the holder to notice")
        assert "taken over by another process" in (lease.lost or "")
        with pytest.raises(safepoint.LeaseError, match="not committing step 1"):
            lease.fence("committing step 1")
    finally:
        lease.release()
    assert store.fs().cat_file(f"{url.split('://', 1)[1]}/.lease") == b"garbage", "release left it alone"
