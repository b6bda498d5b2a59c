"""The CUDA path (issue 27): pinned, reused staging buffers, the device-to-host copy on a side stream that
waits for the loop's stream and for nothing else, async saves through both writers with CUDA RNG restored
bit for bit, and FSDP2 over NCCL (the production template under torchrun, world size 1).

Every test here needs a GPU and skips without one: CI has none. They run on the GPU machine with
``benchmarks/gpu_check.sh`` (docs/benchmarks.md "The GPU path").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import safepoint
from safepoint.save.shared_buffers import buffer_tensors
from safepoint.save.staging import Stager
from tests.conftest import REPO
from tests.helpers.staging_check import check_mixed_state_staging, check_odd_bits_staging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# torch.cuda._sleep spins a kernel for this many GPU clock cycles: about a second at the H100's 1.98 GHz.
SPIN_CYCLES = 2_000_000_000


def cuda_state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {f"t{i}": torch.randn(256, 1024, device="cuda", generator=g) for i in range(8)}


@pytest.mark.parametrize("shared", [False, True], ids=["thread-buffers", "process-arena"])
def test_staging_buffers_are_pinned_and_allocated_once(shared: bool) -> None:
    sd = cuda_state()
    stager = Stager(shared=shared)
    try:
        for i in range(3):
            with torch.no_grad():
                for t in sd.values():
                    t.add_(1.0)
            snap = stager.stage(sd)
            assert all(s.is_pinned() for s in buffer_tensors(snap)), "staging buffers are not pinned"
            for k, t in sd.items():
                assert torch.equal(snap[k], t.cpu()), f"save {i}: {k} staged wrong"
        assert stager.allocations == 1
    finally:
        stager.release()


def test_the_copy_sees_every_update_queued_before_the_save() -> None:
    # The loop's stream is busy (a spinning kernel), then an in-place update is queued behind it. The copy
    # runs on a side stream: unless that stream waits for the loop's, it would copy the old values.
    sd = {"w": torch.zeros(1024, 1024, device="cuda")}
    stager = Stager()
    try:
        stager.stage(sd)  # allocate first: the check below is about ordering, not allocation
        torch.cuda._sleep(SPIN_CYCLES)
        sd["w"].fill_(7.0)
        snap = stager.stage(sd)
        assert bool((snap["w"] == 7.0).all()), "the staged copy missed an update queued before save()"
    finally:
        stager.release()


def test_the_copy_does_not_wait_for_other_streams() -> None:
    # Work on another stream (a prefetch, a collective) must not lengthen the save's block, as a
    # device-wide torch.cuda.synchronize() would: staging returns while that stream is still busy.
    sd = cuda_state()
    stager = Stager()
    other = torch.cuda.Stream()
    try:
        stager.stage(sd)
        torch.cuda.synchronize()
        with torch.cuda.stream(other):
            torch.cuda._sleep(4 * SPIN_CYCLES)
        stager.stage(sd)
        assert not other.query(), "staging waited for an unrelated stream"
    finally:
        other.synchronize()
        stager.release()


@pytest.mark.parametrize("shared", [False, True], ids=["thread-buffers", "process-arena"])
def test_a_staging_that_fails_part_way_leaves_no_copy_in_flight(shared: bool) -> None:
    # A tensor staging cannot copy (one on meta) fails the save after the small CUDA tensors' chunk
    # transfers were queued behind the loop's busy stream: staging raises only once they have run, so the
    # release that may follow (the manager's close: the segment unpinned, the buffers unmapped) never pulls
    # memory from under a DMA still to write it.
    sd = {
        "small": [torch.randn(100, device="cuda") for _ in range(10)],
        "meta": torch.empty(4, device="meta"),
    }
    stager = Stager(shared=shared)
    try:
        torch.cuda._sleep(SPIN_CYCLES)
        with pytest.raises((NotImplementedError, RuntimeError)):
            stager.stage(sd)
        assert stager._stream is not None and stager._stream.query(), "a copy still in flight"
    finally:
        torch.cuda.synchronize()
        stager.release()


@pytest.mark.parametrize("shared", [False, True], ids=["thread-buffers", "process-arena"])
def test_many_small_cuda_tensors_are_gathered_and_see_every_queued_update(shared: bool) -> None:
    # save/gather.py: 3,000 small CUDA tensors reach their pinned buffers through a few chunk transfers on
    # the side stream, which waits for the loop's stream: updates queued behind a spinning kernel reach
    # the snapshot, every tensor bit for bit, and the segment is pinned.
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {"w": [torch.randn(32, 64, device="cuda", generator=g) for _ in range(2000)],
          "m": [torch.randn(100, device="cuda", generator=g).bfloat16() for _ in range(999)],
          "step": torch.tensor(0.0, device="cuda")}  # fmt: skip
    stager = Stager(shared=shared)
    try:
        stager.stage(sd)
        for save in range(1, 4):
            torch.cuda._sleep(SPIN_CYCLES // 4)
            with torch.no_grad():
                for t in [*sd["w"], *sd["m"]]:
                    t.add_(1.0)
                sd["step"].fill_(float(save))
            snap = stager.stage(sd)
            assert stager.gathered == 3000, stager.gathered
            assert all(t.is_pinned() for t in buffer_tensors(snap))
            for a, b in zip(
                [*sd["w"], *sd["m"], sd["step"]], [*snap["w"], *snap["m"], snap["step"]], strict=True
            ):
                assert torch.equal(b, a.cpu()), save
        assert stager.allocations == 1
    finally:
        stager.release()


def test_a_full_gpu_stages_its_small_tensors_one_by_one() -> None:
    # A job that fills its GPU leaves no room for the gather's device buffer (save/gather.py): staging
    # falls back to a transfer per tensor instead of failing the save.
    sd = {f"t{i}": torch.randn(64, 64, device="cuda") for i in range(200)}
    stager = Stager()
    filler: list[torch.Tensor] = []
    try:
        size = 1 << 34
        while size >= 1 << 20:  # take every block of at least 1 MiB the card has left
            try:
                filler.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.cuda.OutOfMemoryError:
                size //= 2
        snap = stager.stage(sd)
        assert stager.gathered == 0
        for k, t in sd.items():
            assert torch.equal(snap[k], t.cpu()), k
    finally:
        filler.clear()
        stager.release()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("shared", [False, True], ids=["thread-buffers", "process-arena"])
def test_batched_staging_of_a_mixed_cuda_state_is_bit_exact(shared: bool) -> None:
    # The batched copy (one torch._foreach_copy_ on the side stream, save/stage_plan.py) with what a real
    # state holds: a tied weight, a non-contiguous view, 0-d tensors, bf16, nested optimizer state, and a
    # CPU tensor beside the CUDA ones. Every snapshot equals the live tensors bit for bit; a tensor replaced
    # by one of the same shape keeps its buffer; a changed shape gets new ones.
    check_mixed_state_staging(torch.device("cuda"), shared, gathered=True)


@pytest.mark.parametrize("shared", [False, True], ids=["thread-buffers", "process-arena"])
def test_gathered_staging_keeps_every_bit_of_odd_values_and_dtypes(shared: bool) -> None:
    # The fused foreach copy converts bf16, fp16 and float8 through float32 (NaN payloads and signs lost)
    # and has no kernel for uint16-64, float8_e8m0fnu or complex32: save/gather.py copies them as
    # same-size integers. Every snapshot holds the live bits (tests/save/test_gather.py: the CPU side).
    def each(stager: Stager) -> None:
        assert stager.gathered == 24, stager.gathered

    check_odd_bits_staging(torch.device("cuda"), shared, each)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.3), nn.Linear(256, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def setup(seed: int) -> tuple[Net, torch.optim.Optimizer, safepoint.TrainState]:
    torch.manual_seed(seed)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, safepoint.TrainState(model=model, optimizer=opt)


def train(model: Net, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """Steps whose data and dropout masks come from the CUDA RNG: only a restored CUDA RNG repeats them."""
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 64, device="cuda")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_async_save_of_a_cuda_state_resumes_bit_for_bit(tmp_path: Path, writer: str) -> None:
    model, opt, state = setup(0)
    opts = safepoint.WriterOptions(async_writer=writer)
    with safepoint.CheckpointManager(tmp_path / "ckpt", async_save=True, writer=opts) as mgr:
        train(model, opt, 3)
        mgr.save(3, state)
        after = train(model, opt, 4)  # runs while the save is written; changes nothing in it
        mgr.wait()
        final = {k: v.clone() for k, v in model.state_dict().items()}
    model2, opt2, state2 = setup(1)
    train(model2, opt2, 1)  # a different CUDA RNG position and different weights
    with safepoint.CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.restore(state2) == 3
    assert train(model2, opt2, 4) == after
    for k, v in model2.state_dict().items():
        assert torch.equal(v, final[k]), k


def test_fsdp2_over_nccl_resumes_bitwise(tmp_path: Path) -> None:
    """The production template (FSDP2, sharded EMA, bf16, workers) under torchrun with NCCL on one GPU:
    a run stopped at step 4 and resumed to 8 equals an uninterrupted run to 8, every key bitwise."""
    script = REPO / "examples" / "production_template.py"
    tiny = [
        *("--steps", "1000", "--warmup", "2", "--save-every", "2", "--samples", "48", "--seq", "8"),
        *("--dim", "32", "--layers", "1", "--heads", "2", "--micro-batch", "4", "--accum", "2"),
    ]
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    def launch(root: Path, until: int) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               str(script), *tiny, "--root", str(root), "--until", str(until)]  # fmt: skip
        done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    launch(tmp_path / "ref", 8)
    launch(tmp_path / "run", 4)
    launch(tmp_path / "run", 8)
    cli = [
        sys.executable,
        "-m",
        "safepoint.cli",
        "diff",
        str(tmp_path / "ref"),
        str(tmp_path / "run"),
        "--step",
        "8",
    ]
    diff = subprocess.run(cli, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert diff.returncode == 0, diff.stdout[-3000:] + diff.stderr[-2000:]
    assert re.search(r"(\d+) keys: \1 identical, 0 differ", diff.stdout), diff.stdout[-2000:]
    print(diff.stdout[-1500:])


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(2048, 2048)  # 16 MiB, frozen
        self.base.requires_grad_(False)
        self.head = nn.Linear(2048, 8)


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_async_saves_skip_unchanged_cuda_tensors_and_restore_bit_for_bit(tmp_path: Path, writer: str) -> None:
    """Issue 26's "async too": with the fused Triton fingerprint usable (the default staging policy), an
    async save copies only what changed to the host; the frozen base is proven unchanged on the GPU, linked
    from the previous step, and the step restores bit for bit."""
    pytest.importorskip("triton")
    from safepoint.save import staging
    from safepoint.store.fingerprint import fast_path
    from tests.store.test_fingerprint_cuda import _dtoh_bytes

    assert staging.FINGERPRINT_CUDA_WHEN_STAGING is None  # the default policy
    assert fast_path(torch.device("cuda", torch.cuda.current_device())), "the Triton kernel failed its probe"
    torch.manual_seed(0)
    model = Frozen().cuda()
    state = safepoint.TrainState(model=model)
    frozen = model.base.weight.nbytes
    opts = safepoint.WriterOptions(async_writer=writer)
    with safepoint.CheckpointManager(tmp_path / "root", async_save=True, writer=opts) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.head.weight.add_(1.0)
            mgr.save(step, state)
            mgr.wait()
        with torch.no_grad():
            model.head.weight.add_(1.0)
        copied = _dtoh_bytes(lambda: mgr.save(3, state), tmp_path)  # what save() blocks for: staging
        mgr.wait()
    assert copied < frozen // 2, copied  # the head and the biases, not the frozen base
    step3 = json.loads((tmp_path / "root" / "step-3" / "safepoint.json").read_text())
    assert step3["extra"]["incremental"]["linked"] >= frozen
    restored = Frozen().cuda()
    with safepoint.CheckpointManager(tmp_path / "root") as mgr:
        assert mgr.restore(safepoint.TrainState(model=restored)) == 3
    for a, b in zip(model.state_dict().values(), restored.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shared", [False, True], ids=["thread-buffers", "process-arena"])
def test_a_cuda_0d_dtensor_is_staged_into_a_host_copy_of_its_own(tmp_path: Path, shared: bool) -> None:
    """torch's ``_create_cpu_state_dict`` returns a 0-d DTensor as it is: the snapshot was the live CUDA
    DTensor, and a write after staging reached it (tests/save/test_private_snapshot.py on CPU)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1
    )
    stager = Stager(shared=shared)
    try:
        mesh = init_device_mesh("cuda", (1,))
        sd = {
            "scale": distribute_tensor(torch.tensor(2.5, device="cuda"), mesh, [Replicate()]),
            "w": distribute_tensor(torch.randn(64, 8, device="cuda"), mesh, [Replicate()]),
        }
        for value in (3.5, 4.5):  # the first staging allocates, the second reuses the buffers
            snap = stager.stage(sd)
            want = {k: v.to_local().cpu() for k, v in sd.items()}
            for k, v in snap.items():
                assert isinstance(v, DTensor) and v is not sd[k] and v.to_local().device.type == "cpu", k
            with torch.no_grad():
                for v in sd.values():
                    v.to_local().fill_(value)
            torch.cuda.synchronize()
            for k, v in snap.items():
                assert torch.equal(v.to_local(), want[k]), k
        assert stager.allocations == 1
    finally:
        stager.release()
        dist.destroy_process_group()
