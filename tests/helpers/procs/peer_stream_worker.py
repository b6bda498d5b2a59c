"""One rank of tests/dist/test_peer_stream.py: a 3-rank gloo group (file rendezvous) runs one
``peer_stream.exchange`` with a small chunk size and reports what it received and its peak memory."""

from __future__ import annotations

import json
import random
import resource
import sys
from pathlib import Path

import crc32c
import torch.distributed as dist

from safepoint.dist import Comm
from safepoint.store.checksum import crc_hex
from safepoint.store.rootfs import RootDir
from safepoint.tiers import peer_stream
from tests.helpers.procs.exiting import run_then_exit

CHUNK = 1 << 20
BIG = 48 * CHUNK + 5  # far more than the chunk: held whole, it would show in the peak memory
PATTERN = random.Random(7).randbytes(CHUNK)


def small(name: str, size: int) -> bytes:
    return random.Random(name).randbytes(size)


def big_crc() -> str:
    value = 0
    for off in range(0, BIG, CHUNK):
        value = crc32c.crc32c(PATTERN[: min(CHUNK, BIG - off)], value)
    return crc_hex(value)


# (sender, receiver, name, size). Rank 2's "wrong" has a wrong crc in the plan, "short" is shorter on its
# disk than the plan says, and "absent" is not on its disk at all: each is refused, the others go on.
SMALL = [
    (0, 1, "empty", 0),
    (0, 1, "one", 1),
    (0, 1, "below", CHUNK - 1),
    (0, 1, "exact", CHUNK),
    (0, 1, "above", CHUNK + 1),
    (0, 1, "several", 5 * CHUNK + 3),
    (1, 2, "ring", 3 * CHUNK),
    (2, 0, "wrong", 100),
    (2, 0, "short", 2 * CHUNK),
    (2, 0, "absent", 10),
    (2, 1, "second-partner", CHUNK + 7),
    (0, 2, "also", 17),
]


def main() -> None:
    rank, work = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=rank, world_size=3)
    comm = Comm(timeout_s=60)
    mine = work / f"disk{rank}"
    mine.mkdir()
    plan: list[tuple[int, int, tuple[str, int, str]]] = []
    for src, dst, name, size in SMALL:
        data = small(name, size)
        crc = "deadbeef" if name == "wrong" else crc_hex(crc32c.crc32c(data))
        plan.append((src, dst, (name, size, crc)))
        if rank == src and name != "absent":
            (mine / name).write_bytes(data[: size // 2] if name == "short" else data)
    plan.append((1, 0, ("big", BIG, big_crc())))
    if rank == 1:
        with open(mine / "big", "wb") as f:
            for off in range(0, BIG, CHUNK):
                f.write(PATTERN[: min(CHUNK, BIG - off)])
    if rank == 1:
        # The receiving directory already holds what a hostile local root can plant: a directory where a
        # received file goes, and a symlink where its .part goes (pointing outside the root).
        (work / "in1" / "exact").mkdir(parents=True)
        (work / "outside").write_bytes(b"precious")
        (work / "in1" / "below.part").symlink_to(work / "outside")
    read = {entry[0]: f"disk{rank}/{entry[0]}" for src, _, entry in plan if src == rank}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = peer_stream.exchange(comm, plan, RootDir(work), read, f"in{rank}", chunk=CHUNK)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    same = {}
    for name, path in got.items():
        size = next(e[1] for _, _, e in plan if e[0] == name)
        want = small(name, size) if name != "big" else None
        same[name] = path.read_bytes() == want if want is not None else path.stat().st_size == BIG
    leftovers = sorted(p.name for p in (work / f"in{rank}").iterdir()) if got or rank == 0 else []
    (work / f"result{rank}.json").write_text(
        json.dumps(
            {"received": sorted(got), "same": same, "peak_growth_kib": after - before, "files": leftovers}
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    run_then_exit(main)  # never through the teardown: tests/helpers/procs/exiting.py
