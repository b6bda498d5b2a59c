"""torchtitan's real Llama 3 debug model on CPU, for the checkpointer tests.

``torchtitan.models`` imports its expert-parallel kernels (``distributed/minimal_async_ep/kernels.py``), which
import triton: a GPU compiler this CPU test environment does not install. Where triton is missing, that one
module is replaced by a stand-in whose kernels raise if called; the dense Llama 3 model never calls them (they
serve MoE expert parallelism only). A stand-in for triton itself would not do: torch's inductor imports
whatever ``triton`` it finds. Everything else is torchtitan's own code: the model class, its fused ``wqkv``
layer and that layer's state-dict hooks.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import torch

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)
VOCAB, SEQ = 2048, 16  # the debug model's vocabulary; a short sequence keeps a CPU step fast


def _without_triton() -> None:
    if importlib.util.find_spec("triton") is not None or _KERNELS in sys.modules:
        return
    stand_in = types.ModuleType(_KERNELS)

    def _needs_triton(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("torchtitan's expert-parallel kernels need triton, which is not installed")

    for name in _KERNEL_NAMES:
        setattr(stand_in, name, _needs_triton)
    sys.modules[_KERNELS] = stand_in


def debug_model(seed: int, *, fuse_qkv: bool = True, layers: int | None = None) -> torch.nn.Module:
    """torchtitan's ``llama3`` ``debugmodel`` (dim 256, 6 layers, vocab 2048; its attention's ``wq``/``wk``/
    ``wv`` fused into one ``wqkv``, as torchtitan builds it), on CPU, its weights initialised from ``seed``.
    FlexAttention has no CPU backward: SDPA instead (the projections, and so the state dict, are the same).
    ``layers``: only the first that many of its blocks (the same classes; a faster build on a loaded CPU)."""
    _without_triton()
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    if layers is not None:
        spec.model.layers = spec.model.layers[:layers]
    if not fuse_qkv:
        from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim
        from torchtitan.models.llama3 import _build_llama3_layers

        dim, n_heads = 256, 16
        spec.model.layers = _build_llama3_layers(
            fuse_qkv=False,
            n_layers=len(spec.model.layers),
            dim=dim,
            n_heads=n_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend="flex",  # then SDPA, below
        )
    for _fqn, _cfg, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    torch.manual_seed(seed)
    model = spec.model.build()
    model.init_weights(buffer_device=None)
    return model


def train_step(model: torch.nn.Module, optimizer: Any, step: int) -> float:
    """One next-token step on tokens drawn from ``step``."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.item())
