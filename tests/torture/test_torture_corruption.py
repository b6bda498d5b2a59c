"""Corruption matrix: every file of a two-file-per-rank checkpoint (writer_threads=2), damaged every way.

Files: ``__0_0.distcp``, ``__0_1.distcp``, ``.metadata``, ``safepoint.json``. Damage: a byte flipped (random
position, random non-zero mask), truncation (random length), zero-fill (the whole file, a random range),
deletion, and extension (bytes appended). For every case: ``Layout.verify`` detects it (or, for a deleted
manifest, the step is no longer a checkpoint at all), and restore falls back to the previous checkpoint
with a warning naming the step and the file, its state bitwise equal to that step's.

A flip in the manifest's indentation that turns one JSON whitespace character into another (``\\n`` into
``\\t``, say) leaves the manifest meaning exactly the same: such cases are counted as *content-neutral*,
and for them restore must load the newest checkpoint, intact. Every other case must be detected.

The default run draws a few positions per file; ``-m slow`` flips every byte of the manifest and of
.metadata, truncates the manifest at every length, samples 1000 flips and 200 truncations of each data
file (verify), and restores a random sample of 300+.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import safepoint
from safepoint.errors import CheckpointError
from safepoint.store.manifest import Manifest
from safepoint.store.posix_layout import Layout
from tests.helpers.train import Setup, assert_bitwise_equal
from tests.torture import checks

FILES = ["__0_0.distcp", "__0_1.distcp", ".metadata", "rank-0.fingerprints", "rank-0.state", "safepoint.json"]


class Matrix:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.step2 = root / "step-2"
        s = Setup()
        with safepoint.CheckpointManager(root, writer=safepoint.WriterOptions(threads=2)) as mgr:
            s.step()
            mgr.save(1, s.state())
            self.at1 = s.snapshot()
            s.step()
            mgr.save(2, s.state())
            self.at2 = s.snapshot()
        self.pristine = {name: (self.step2 / name).read_bytes() for name in FILES}
        self.manifest = Manifest.from_json(self.pristine["safepoint.json"], step_hint=2)
        self.detected = 0
        self.neutral = 0
        self.restores = 0
        self.misses: list[str] = []

    def put_back(self, name: str) -> None:
        (self.step2 / name).write_bytes(self.pristine[name])

    def case(self, name: str, label: str, damage: Callable[[bytes], bytes | None], restore: bool) -> None:
        """Apply ``damage`` (None: delete the file), check detection, optionally restore; put the file back."""
        data = damage(self.pristine[name])
        path = self.step2 / name
        if data is None:
            path.unlink()
        elif data == self.pristine[name]:
            return  # not a corruption at all (e.g. zeroing bytes that were zero)
        else:
            path.write_bytes(data)
        try:
            self._check(name, label, data, restore)
        finally:
            self.put_back(name)

    def _neutral(self, name: str, data: bytes | None) -> bool:
        if name != "safepoint.json" or data is None:
            return False
        try:
            return Manifest.from_json(data, step_hint=2) == self.manifest
        except CheckpointError:
            return False

    def _check(self, name: str, label: str, data: bytes | None, restore: bool) -> None:
        layout = Layout(self.root)
        neutral = self._neutral(name, data)
        listed = 2 in layout.committed_steps()
        caught = not listed
        if listed:
            try:
                layout.verify(2)
            except CheckpointError:
                caught = True
        if neutral:
            self.neutral += 1
            if caught:
                self.misses.append(f"{name} {label}: a content-neutral change was rejected")
        elif caught:
            self.detected += 1
        else:
            self.misses.append(f"{name} {label}: NOT detected by verify")
            return
        if not restore:
            return
        s = Setup(seed=9)
        with warnings.catch_warnings(record=True) as caught_warnings:
            warnings.simplefilter("always")
            with safepoint.CheckpointManager(self.root) as mgr:
                step = mgr.restore(s.state(rng=False))
        self.restores += 1
        want, snap = (2, self.at2) if neutral else (1, self.at1)
        if step != want:
            self.misses.append(f"{name} {label}: restore returned step {step}, expected {want}")
            return
        try:
            assert_bitwise_equal(snap, s.snapshot())
        except AssertionError as e:
            self.misses.append(f"{name} {label}: restored state differs: {e}")
        named = [w for w in caught_warnings if issubclass(w.category, safepoint.CheckpointWarning)]
        if not neutral and listed and not any(f"step 2, file '{name}'" in str(w.message) for w in named):
            self.misses.append(f"{name} {label}: no warning naming step 2 and the file ({named})")


def _flip(pos: int, mask: int) -> Callable[[bytes], bytes]:
    def damage(b: bytes) -> bytes:
        out = bytearray(b)
        out[pos] ^= mask
        return bytes(out)

    return damage


def _cases(
    m: Matrix, rng: random.Random, flips: int, truncations: int
) -> Iterator[tuple[str, str, Callable[[bytes], bytes | None]]]:
    for name in FILES:
        size = len(m.pristine[name])
        for pos in rng.sample(range(size), min(flips, size)):
            mask = rng.randrange(1, 256)
            yield name, f"flip byte {pos} ^ {mask:#04x}", _flip(pos, mask)
        for n in rng.sample(range(size), min(truncations, size)):
            yield name, f"truncate to {n}", lambda b, n=n: b[:n]
        a = rng.randrange(size)
        b = rng.randrange(a + 1, size + 1)
        yield name, "zero-fill", lambda d: bytes(len(d))
        yield name, f"zero bytes {a}:{b}", lambda d, a=a, b=b: d[:a] + bytes(b - a) + d[b:]
        yield name, "append 16 bytes", lambda d: d + bytes(rng.randrange(256) for _ in range(16))
        yield name, "delete", lambda d: None


@pytest.fixture
def matrix(tmp_path: Path) -> Matrix:
    m = Matrix(tmp_path / "ckpt")
    assert sorted(p.name for p in m.step2.iterdir()) == sorted(FILES), (
        "expected two data files, a rank file and its fingerprints"
    )
    return m


def test_every_file_every_damage_is_detected_and_falls_back(matrix: Matrix) -> None:
    rng = random.Random(8)
    cases = list(_cases(matrix, rng, flips=3, truncations=2))
    for name, label, damage in cases:
        matrix.case(name, label, damage, restore=True)
    checks.record_figures(
        "corruption-default",
        detected=matrix.detected,
        neutral=matrix.neutral,
        restores=matrix.restores,
        misses=len(matrix.misses),
    )
    assert matrix.misses == []
    assert matrix.detected >= 4 * 7
    # Untouched, step 2 is intact and restores.
    s = Setup(seed=9)
    with safepoint.CheckpointManager(matrix.root) as mgr:
        assert mgr.restore(s.state(rng=False)) == 2
    assert_bitwise_equal(matrix.at2, s.snapshot())


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_byte_of_every_file(matrix: Matrix) -> None:
    """Every byte of the manifest and of .metadata flipped, every truncation of the manifest; 1000 random
    flips and 200 random truncations of each data file (tens of KB: crc32c detects every burst error of
    up to 32 bits, so positions in them are samples of one guarantee); a large restore sample."""
    rng = random.Random(9)
    for name in FILES:
        size = len(matrix.pristine[name])
        small = name in ("safepoint.json", ".metadata")
        for pos in range(size) if small else rng.sample(range(size), 1000):
            matrix.case(name, f"flip byte {pos}", _flip(pos, rng.randrange(1, 256)), restore=False)
        for n in range(size) if name == "safepoint.json" else rng.sample(range(size), 200):
            matrix.case(name, f"truncate to {n}", lambda b, n=n: b[:n], restore=False)
    sample = list(_cases(matrix, rng, flips=60, truncations=15))
    for name, label, damage in sample:
        matrix.case(name, label, damage, restore=True)
    checks.record_figures(
        "corruption-slow",
        detected=matrix.detected,
        neutral=matrix.neutral,
        restores=matrix.restores,
        misses=len(matrix.misses),
    )
    assert matrix.misses == []
    assert matrix.restores >= 300


def test_restore_never_loads_a_flipped_tensor_even_without_the_manifest_check(tmp_path: Path) -> None:
    """The checksums are what stands between a flipped byte and the model: with every file's crc32c in the
    manifest, a flip inside a tensor's bytes (which DCP itself would load silently) is refused."""
    root = tmp_path / "ckpt"
    m = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        m.weight.fill_(1.0)
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=m, rng=False))
    data = bytearray((root / "step-1" / "__0_0.distcp").read_bytes())
    ones = data.find(bytes.fromhex("0000803f") * 64)  # a run of float32 1.0: the weight's bytes
    assert ones > 0
    data[ones + 2] ^= 0x40
    (root / "step-1" / "__0_0.distcp").write_bytes(bytes(data))
    # Plain DCP loads the flipped weight without complaint ...
    from torch.distributed.checkpoint import load as dcp_load

    sd = {"model": {"weight": torch.zeros(64, 64)}}
    dcp_load(sd, checkpoint_id=str(root / "step-1"), no_dist=True)
    assert not torch.all(sd["model"]["weight"] == 1.0)
    # ... safepoint refuses it.
    with pytest.raises(safepoint.CorruptCheckpointError, match="crc32c"):
        Layout(root).verify(1)
