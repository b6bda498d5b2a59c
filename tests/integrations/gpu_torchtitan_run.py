"""A real torchtitan 0.3 ``Trainer`` run with safepoint's checkpointer chosen through its config.

Not a pytest module: a script for the GPU machine (and, with ``--device cpu``, for a CPU check on gloo;
torchtitan's ``Trainer`` imports triton, so there triton must be importable: ``pip install --target DIR
triton==3.6.0`` and DIR on ``PYTHONPATH``; its kernels are never run on the CPU).

    python tests/integrations/gpu_torchtitan_run.py [--device cuda|cpu] [--workdir DIR]

Each launch is ``torchrun --standalone --nproc-per-node 1`` of this file with ``--worker``, which builds
torchtitan's ``Trainer`` from a ``Trainer.Config`` (the Llama 3 ``debugmodel``, FlexAttention, AdamW, the
warmup+linear-decay schedule of torchtitan's debug config) whose ``checkpoint`` field is
``SafepointCheckpointManager.Config``, then calls ``trainer.train()`` and ``trainer.close()`` as
torchtitan's ``train.py`` does. Nothing is downloaded: the tokenizer is a WordLevel ``tokenizers`` model
written to a temp dir (read by torchtitan's own ``HuggingFaceTokenizer``) and the data are synthetic
documents packed as torchtitan's ``HuggingFaceTextDataset`` packs them.

- run A: 8 steps, a checkpoint every 2;
- run B: the same job stopped after step 4, then a second launch resumes it (from safepoint's newest intact
  checkpoint, step 4) to step 8; that launch also saves what it loaded into a second root ("echo");
- checks: B's losses of steps 5-8 equal A's bit for bit, ``safepoint diff`` of A's and B's step 8 (the
  whole state: model, optimizer, scheduler, data position, RNG, train state) finds every tensor identical,
  ``safepoint verify --all`` passes on both roots. If A's and B's first four steps (no resume between them)
  already differ, the kernels are not deterministic across processes: the script says so and checks
  instead that the resumed launch loaded exactly B's step-4 checkpoint (``safepoint diff`` against the echo).

Exit 0 only if the checks pass; every check prints one line (``CHECK ... ok|FAILED``).

The debug model is built as torchtitan builds it, its attention's ``wq``/``wk``/``wv`` fused into one ``wqkv``
(``--qkv unfused``: the same layers unfused, what the first GPU run used). The fused layer's state-dict hooks
rename its keys; safepoint saves and loads such a module as torchtitan's own checkpointer does
(``safepoint/data/module_state.py``, checked on CPU with the real model class by
tests/integrations/test_torchtitan_fused.py); this script has not yet run with it on a GPU. The loss is the
plain cross entropy (``--loss chunked`` reproduces the failure: torchtitan's ``ChunkedLossWrapper`` runs
``lm_head`` outside the FSDP root's forward; on torch 2.11 its backward then meets a freed parameter: "The
tensor has a non-zero number of elements, but its data is not allocated yet").

Compatibility shims for torch older than torchtitan 0.3 targets, each printed when used (none touches what
the checkpointer saves or loads): ``datasets`` (imported by torchtitan's validator module, never used here:
a stand-in that raises if called); ``torch.distributed.fsdp.DataParallelMeshDims`` (imported at module level;
torchtitan builds one only for FSDP/full_dtensor meshes larger than one rank); ``torch.distributed.set_timeout``
(called once after the first step; torch 2.11-2.13 have it as ``_set_pg_timeout``). ``--device cpu`` also
makes torchtitan pick the CPU (it assumes CUDA when no accelerator is found) and gives ``torch.cpu`` the
memory-monitor functions its metrics ask for; FlexAttention has no CPU backward, so CPU runs use SDPA.

Checked on CPU (gloo) here with torch 2.11.0+cu130 (the GPU machine's build): every check passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

TAG = "SPTT"  # prefix of the worker's machine-readable lines
WORDS = 500  # the tokenizer's word vocabulary (the debug model's vocab is 2048)


# ---- compatibility, before torchtitan is imported --------------------------------------------------


def _shims(device: str) -> None:
    if importlib.util.find_spec("datasets") is None:
        # torchtitan.trainer -> components.validate -> hf_datasets.text_datasets imports HF datasets at
        # module level; this job uses its own dataloader and no validator.
        def _absent(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError("HF datasets is not installed (stand-in module)")

        ds = types.ModuleType("datasets")
        ds.Dataset = type("Dataset", (), {})  # type: ignore[attr-defined]
        ds.load_dataset = _absent  # type: ignore[attr-defined]
        dist_mod = types.ModuleType("datasets.distributed")
        dist_mod.split_dataset_by_node = _absent  # type: ignore[attr-defined]
        ds.distributed = dist_mod  # type: ignore[attr-defined]
        sys.modules["datasets"], sys.modules["datasets.distributed"] = ds, dist_mod
        print(f"{TAG} shim: HF datasets not installed: a stand-in module (never called)", flush=True)
    import torch
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:  # torchtitan 0.3 reads .shard and .replicate
            shard: Any = None
            replicate: Any = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims  # type: ignore[attr-defined]
        print(
            f"{TAG} shim: torch {torch.__version__} has no fsdp.DataParallelMeshDims: a stand-in", flush=True
        )
    if not hasattr(torch.distributed, "set_timeout"):
        # torchtitan 0.3's set_pg_timeouts (called once, after the first step) uses a public
        # torch.distributed.set_timeout newer than torch 2.13; torch has long had it as _set_pg_timeout.
        from torch.distributed.distributed_c10d import _set_pg_timeout

        torch.distributed.set_timeout = _set_pg_timeout  # type: ignore[attr-defined]
        print(
            f"{TAG} shim: torch {torch.__version__} has no distributed.set_timeout: _set_pg_timeout",
            flush=True,
        )
    if device == "cpu":
        # torchtitan picks "cuda" when no accelerator is found; the CPU check runs it on cpu with gloo.
        import torch._utils

        torch._utils._get_available_device_type = lambda: "cpu"
        # ... and its metrics' device memory monitor asks the device module for names and memory stats,
        # which torch.cpu lacks (observability only: nothing the checkpointer or the losses depend on).
        props = types.SimpleNamespace(name="cpu", total_memory=1 << 30)
        for name, fn in {
            "get_device_name": lambda *_a: "cpu",
            "get_device_properties": lambda *_a: props,
            "reset_peak_memory_stats": lambda *_a: None,
            "empty_cache": lambda *_a: None,
            "memory_stats": lambda *_a: {},
        }.items():
            if not hasattr(torch.cpu, name):
                setattr(torch.cpu, name, fn)
        # set_pg_timeouts calls barrier(device_ids=[device_module.current_device()]): "cpu" is no device id.
        barrier = torch.distributed.barrier

        def barrier_without_ids(*a: Any, device_ids: Any = None, **k: Any) -> Any:
            return barrier(*a, **k)

        torch.distributed.barrier = barrier_without_ids


# ---- tokenizer and data --------------------------------------------------------------------------------


def write_tokenizer(folder: Path) -> None:
    """A WordLevel tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) as torchtitan's
    ``HuggingFaceTokenizer`` loads it from ``hf_assets_path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "[UNK]"]
    vocab = {tok: i for i, tok in enumerate(specials + [_word(i) for i in range(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": specials[0], "eos_token": specials[1], "unk_token": specials[2]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _word(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return letters[i % 26] + letters[(i // 26) % 26] + str(i)


def _document(idx: int) -> str:
    """Document ``idx`` of an endless synthetic corpus: word bigrams with structure a model can learn."""
    rng = random.Random(idx)
    n = rng.randint(20, 200)
    w = rng.randrange(WORDS)
    out = []
    for _ in range(n):
        out.append(_word(w))
        w = (w * 7 + rng.choice((1, 2, 3))) % WORDS
    return " ".join(out)


def _normalize(positions: list[int]) -> list[int]:
    """torchtitan's ``_normalize_positions``: a row that starts mid-document counts that document from 0."""
    offset = positions[0]
    for i, p in enumerate(positions):
        if p == 0:
            break
        positions[i] = p - offset
    return positions


def _loader_class() -> Any:
    """Built after torchtitan is importable: the dataloader ``Trainer.Config.dataloader`` selects."""
    import torch
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader

    class SyntheticText(IterableDataset, Stateful):  # type: ignore[misc]
        """``HuggingFaceTextDataset``'s packing (shifted labels per document, per-document positions,
        seq_len rows) over ``_document``; its position is ``sample_idx`` and the packing buffers."""

        def __init__(self, tokenizer: Any, seq_len: int, dp_rank: int, dp_world_size: int) -> None:
            self.tokenizer, self.seq_len = tokenizer, seq_len
            self.rank, self.world = dp_rank, dp_world_size
            self.sample_idx = 0
            self.inputs: list[int] = []
            self.labels: list[int] = []
            self.positions: list[int] = []

        def __iter__(self) -> Any:
            while True:
                doc = _document(self.rank + self.sample_idx * self.world)
                self.sample_idx += 1
                ids = self.tokenizer.encode(doc, add_bos=True, add_eos=True)
                self.inputs += ids[:-1]
                self.labels += ids[1:]
                self.positions += range(len(ids) - 1)
                while len(self.inputs) >= self.seq_len:
                    n = self.seq_len
                    pos = _normalize(self.positions[:n])
                    x, y = torch.LongTensor(self.inputs[:n]), torch.LongTensor(self.labels[:n])
                    self.inputs, self.labels = self.inputs[n:], self.labels[n:]
                    self.positions = self.positions[n:]
                    yield {"input": x, "positions": torch.LongTensor(pos)}, y

        def state_dict(self) -> dict[str, Any]:
            return {
                "sample_idx": self.sample_idx,
                "inputs": list(self.inputs),
                "labels": list(self.labels),
                "positions": list(self.positions),
            }

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.sample_idx = sd["sample_idx"]
            self.inputs, self.labels = list(sd["inputs"]), list(sd["labels"])
            self.positions = list(sd["positions"])

    class SyntheticTextLoader(ParallelAwareDataloader):  # type: ignore[misc]
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):  # type: ignore[misc]
            pass

        def __init__(
            self,
            config: Config,
            *,
            dp_world_size: int,
            dp_rank: int,
            tokenizer: Any,
            seq_len: int,
            local_batch_size: int,
            snapshot_every_n_steps: int | None = 1,
            **_kwargs: Any,
        ) -> None:
            super().__init__(
                SyntheticText(tokenizer, seq_len, dp_rank, dp_world_size),
                dp_rank=dp_rank,
                dp_world_size=dp_world_size,
                batch_size=local_batch_size,
                num_workers=config.num_workers,
                snapshot_every_n_steps=snapshot_every_n_steps,
            )

    return SyntheticTextLoader


# ---- the worker: one torchtitan training job --------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    _shims(args.device)
    import torch
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.tools.logging import init_logger
    from torchtitan.trainer import Trainer

    from safepoint.integrations.torchtitan import SafepointCheckpointManager

    init_logger()
    print(f"{TAG} torch {torch.__version__} cuda {torch.version.cuda} device {args.device}", flush=True)
    model_spec = model_registry("debugmodel")  # dim 256, 6 layers, vocab 2048, FlexAttention
    if args.qkv == "unfused":
        # The debug model fuses wq/wk/wv into one wqkv (its state-dict hooks split and merge the keys):
        # the same layers, unfused, as the first GPU run had them.
        from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim
        from torchtitan.models.llama3 import _build_llama3_layers

        dim, n_heads = 256, 16
        model_spec.model.layers = _build_llama3_layers(
            fuse_qkv=False,
            n_layers=len(model_spec.model.layers),
            dim=dim,
            n_heads=n_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend="flex",
        )
    if args.attention == "sdpa":  # FlexAttention has no backward on CPU: SDPA, causal over the whole row
        from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

        for _fqn, _cfg, parent, attr in list(model_spec.model.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
        if args.device == "cuda":
            # The flash and cuDNN backward passes add dQ with atomics: not bitwise reproducible across
            # processes (the first GPU run of the fused model saw wq differ by 4e-7 at step 8 with every
            # loss equal). The math backend is deterministic, so a difference left is the checkpointer's.
            from torch.nn.attention import SDPBackend

            ScaledDotProductAttention.sdpa_backends = [SDPBackend.MATH]
    cross_entropy = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))
    config = Trainer.Config(
        loss=(ChunkedLossWrapper.Config(loss_fn=cross_entropy) if args.loss == "chunked" else cross_entropy),
        hf_assets_path=args.assets,
        dump_folder=args.root,
        model_spec=model_spec,
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(
            local_batch_size=args.batch,
            seq_len=args.seq_len,
            steps=args.steps,
            disable_cuda_graphs=True,
        ),
        dataloader=_loader_class().Config(),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(spmd_backend=args.spmd_backend),
        checkpoint=SafepointCheckpointManager.Config(
            enable=True, folder="checkpoint", interval=args.save_every
        ),
        activation_checkpoint=None if args.no_ac else SelectiveAC.Config(),
        debug=DebugConfig(
            seed=42, deterministic=True, deterministic_warn_only=True, detect_anomaly=args.detect_anomaly
        ),
    )
    trainer = config.build()
    assert isinstance(trainer.checkpointer, SafepointCheckpointManager), type(trainer.checkpointer)
    log = trainer.metrics_processor.log

    def log_and_print(step: int, loss: float, max_loss: float, grad_norm: float, **kw: Any) -> Any:
        print(f"{TAG} step {step} loss {loss!r} grad_norm {grad_norm!r}", flush=True)
        return log(step, loss, max_loss, grad_norm, **kw)

    trainer.metrics_processor.log = log_and_print
    load = trainer.checkpointer.load

    def load_and_echo(step: int = -1) -> bool:
        loaded = bool(load(step=step))
        print(f"{TAG} loaded {loaded} at step {trainer.step}", flush=True)
        if loaded and args.echo_root:  # what this launch resumes from, saved again into another root
            echo = SafepointCheckpointManager.Config(
                enable=True, folder="checkpoint", interval=1, async_save=False
            ).build(
                dataloader=trainer.dataloader,
                model_parts=trainer.model_parts,
                optimizers=trainer.optimizers,
                lr_schedulers=trainer.lr_schedulers,
                states={"train_state": trainer},
                base_folder=args.echo_root,
            )
            echo.save(trainer.step, last_step=True)
            echo.close()
        return loaded

    trainer.checkpointer.load = load_and_echo
    if args.stop_after:
        stop = args.stop_after  # the job ends after this step (its checkpoint is on the interval)
        trainer.should_continue_training = lambda: trainer.step < min(stop, args.steps)
    try:
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    print(f"{TAG} done at step {trainer.step}", flush=True)


# ---- the driver ----------------------------------------------------------------------------------------


def _launch(args: argparse.Namespace, root: Path, *extra: str) -> dict[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    cmd += [__file__, "--worker", "--root", str(root), "--assets", str(args.workdir / "assets")]
    cmd += ["--device", args.device, "--steps", str(args.steps), "--save-every", str(args.save_every)]
    cmd += ["--batch", str(args.batch), "--seq-len", str(args.seq_len), "--spmd-backend", args.spmd_backend]
    cmd += ["--attention", args.attention, "--qkv", args.qkv, "--loss", args.loss]
    cmd += list(extra)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(args.workdir / "inductor-cache"))
    if args.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(TAG)]
    print("\n".join(lines), flush=True)
    print(f"(rc {done.returncode}, {time.monotonic() - t0:.1f} s)", flush=True)
    if done.returncode != 0:
        print(done.stdout[-6000:], "\n---- stderr ----\n", done.stderr[-12000:], flush=True)
        raise SystemExit(f"FAILED: the torchtitan job {root.name} exited {done.returncode}")
    found = re.findall(rf"^{TAG} step (\d+) loss (\S+) grad_norm", done.stdout, re.M)
    return {int(s): loss for s, loss in found}


def _cli(*argv: str) -> tuple[int, str]:
    env = dict(os.environ, COLUMNS="400")  # one table row per key
    done = subprocess.run(
        [sys.executable, "-m", "safepoint.cli", *argv], capture_output=True, text=True, timeout=300, env=env
    )
    out = (done.stdout + done.stderr).strip()
    print(f"$ safepoint {' '.join(argv)}  (exit {done.returncode})\n{out}", flush=True)
    return done.returncode, out


def _diff(root_a: Path, root_b: Path, step: int) -> tuple[bool, list[str]]:
    """``safepoint diff``: (every key but the RNG identical, the RNG keys that differ).

    RNG states may differ and are reported: torchtitan seeds torch only (each process draws its own Python
    and NumPy states), and the DataLoader draws its base seed from torch's CPU generator whenever an
    iterator is made (a resumed process makes its iterator after the restore)."""
    rc, out = _cli("diff", str(root_a), str(root_b), "--step", str(step))
    if rc == 0:
        return True, []
    keys = [ln.split("│")[1].strip() for ln in out.splitlines() if ln.startswith("│")]
    summary = re.search(r"(\d+) shape mismatches, (\d+) only in \S+, (\d+) only in", out)
    other = [k for k in keys if not k.startswith("rng.")]
    ok = bool(keys) and not other and summary is not None and summary.groups() == ("0", "0", "0")
    return ok, [k for k in keys if k.startswith("rng.")]


def _committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "safepoint.json").is_file())


def driver(args: argparse.Namespace) -> int:
    args.workdir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.workdir / "assets")
    a, b, echo = args.workdir / "A", args.workdir / "B", args.workdir / "B-echo"
    steps, stop = args.steps, args.stop_after
    losses_a = _launch(args, a)
    losses_b1 = _launch(args, b, "--stop-after", str(stop))
    losses_b2 = _launch(args, b, "--echo-root", str(echo))
    results: list[tuple[str, bool]] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        results.append((name, ok))
        print(f"CHECK {name}: {'ok' if ok else 'FAILED'}{' - ' + detail if detail else ''}", flush=True)

    print("\n==== checks", flush=True)
    check("run A trained steps 1..N", sorted(losses_a) == list(range(1, steps + 1)), str(sorted(losses_a)))
    check("run B stopped after step 4", sorted(losses_b1) == list(range(1, stop + 1)), str(sorted(losses_b1)))
    resumed = sorted(losses_b2)
    check("run B resumed at step 5 and ended at N", resumed == list(range(stop + 1, steps + 1)), str(resumed))
    check(
        "checkpoints committed",
        _committed(a / "checkpoint") == list(range(args.save_every, steps + 1, args.save_every))
        and _committed(b / "checkpoint")[-1] == steps,
        f"A {_committed(a / 'checkpoint')} B {_committed(b / 'checkpoint')}",
    )
    # Deterministic across processes: the same losses AND the same whole state at step ``stop`` for A and B,
    # two runs with no resume between them (a loss can keep its bits while a weight moves by an ulp).
    same_state, _ = _diff(a / "checkpoint", b / "checkpoint", stop)
    deterministic = same_state and all(losses_b1.get(s) == losses_a.get(s) for s in range(1, stop + 1))
    print(
        f"cross-process determinism (A vs B steps 1-{stop}, no resume between them): {deterministic}"
        f" (state at step {stop} identical but the RNG: {same_state})\n"
        + "\n".join(
            f"  step {s}: A {losses_a.get(s)}  B {losses_b1.get(s) or losses_b2.get(s)}"
            for s in range(1, steps + 1)
        ),
        flush=True,
    )
    for root in (a / "checkpoint", b / "checkpoint"):
        rc, _ = _cli("verify", str(root), "--all")
        check(f"safepoint verify --all {root.parent.name}", rc == 0)
    if deterministic:
        same = [s for s in range(stop + 1, steps + 1) if losses_b2.get(s) == losses_a.get(s)]
        check(
            f"B's losses of steps {stop + 1}-{steps} equal A's bit for bit",
            len(same) == steps - stop,
            f"equal at {same}",
        )
        ok, rng = _diff(a / "checkpoint", b / "checkpoint", steps)
        check(
            f"safepoint diff A B --step {steps}: every key but the RNG identical", ok, f"RNG differs: {rng}"
        )
    else:
        print(
            "NOTE: torchtitan's kernels on this device are not bitwise deterministic across processes "
            "(A and B differ before any resume); checking the resumed state instead.",
            flush=True,
        )
    ok, rng = _diff(b / "checkpoint", echo / "checkpoint", stop)
    check(
        f"what the resumed launch loaded is B's step-{stop} checkpoint (safepoint diff vs echo, but the RNG)",
        ok,
        f"RNG differs: {rng}",
    )
    failed = [n for n, ok in results if not ok]
    print(f"\nRESULT: {'PASS' if not failed else 'FAIL: ' + '; '.join(failed)}", flush=True)
    return 0 if not failed else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--workdir", type=Path, default=None, help="default: a new temp dir")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--stop-after", type=int, default=None, help="run B's first launch ends here (default 4)")
    p.add_argument("--batch", type=int, default=None, help="default: 4 (cuda), 2 (cpu)")
    p.add_argument("--seq-len", type=int, default=None, help="default: 512 (cuda), 128 (cpu)")
    p.add_argument(
        "--attention", choices=("flex", "sdpa"), default=None, help="default: flex (cuda), sdpa (cpu)"
    )
    p.add_argument("--detect-anomaly", action="store_true", help="autograd anomaly detection (debugging)")
    p.add_argument("--loss", choices=("chunked", "plain"), default="plain", help="ChunkedLossWrapper or not")
    p.add_argument(
        "--qkv",
        choices=("unfused", "fused"),
        default="fused",
        help="debugmodel's wqkv fused (its default) or not",
    )
    p.add_argument("--no-ac", action="store_true", help="no activation checkpointing (default: selective)")
    p.add_argument("--spmd-backend", default="spmd_types", choices=("spmd_types", "partial_dtensor"))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--assets", help=argparse.SUPPRESS)
    p.add_argument("--echo-root", help=argparse.SUPPRESS)
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.batch = args.batch or (4 if cuda else 2)
    args.seq_len = args.seq_len or (512 if cuda else 128)
    args.attention = args.attention or ("flex" if cuda else "sdpa")
    if args.worker:
        worker(args)  # --stop-after only when the driver passes it
        return 0
    args.stop_after = args.stop_after or 4
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="safepoint-torchtitan-"))
    return driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
