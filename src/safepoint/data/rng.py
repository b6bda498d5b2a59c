"""Per-rank RNG state as plain tensors (never pickled): Python ``random``, NumPy's global generator,
torch CPU and every initialised CUDA device."""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np
import torch

PY_STATE = "python_state"
PY_GAUSS = "python_gauss"
NP_KEYS = "numpy_keys"
NP_POS = "numpy_pos"
NP_GAUSS = "numpy_gauss"
TORCH_CPU = "torch_cpu"
CUDA_PREFIX = "cuda_"

RngState = dict[str, torch.Tensor]


def capture_rng() -> RngState:
    version, internal, gauss_next = random.getstate()
    if version != 3:  # CPython's format since 3.2; anything else we cannot encode faithfully
        raise RuntimeError(f"unsupported Python random state version {version}")
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    if name != "MT19937":
        raise RuntimeError(f"unsupported NumPy bit generator {name}")
    state: RngState = {
        PY_STATE: torch.tensor(internal, dtype=torch.int64),
        PY_GAUSS: torch.tensor([math.nan if gauss_next is None else gauss_next], dtype=torch.float64),
        NP_KEYS: torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
        NP_POS: torch.tensor([pos, has_gauss], dtype=torch.int64),
        NP_GAUSS: torch.tensor([cached], dtype=torch.float64),
        TORCH_CPU: torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        for i in range(torch.cuda.device_count()):
            state[f"{CUDA_PREFIX}{i}"] = torch.cuda.get_rng_state(i)
    return state


def restore_rng(state: RngState) -> None:
    gauss = float(state[PY_GAUSS][0])
    random.setstate(
        (3, tuple(int(x) for x in state[PY_STATE].tolist()), None if math.isnan(gauss) else gauss)
    )
    pos, has_gauss = (int(x) for x in state[NP_POS].tolist())
    np.random.set_state(
        ("MT19937", state[NP_KEYS].numpy().astype(np.uint32), pos, has_gauss, float(state[NP_GAUSS][0]))
    )
    torch.set_rng_state(state[TORCH_CPU].contiguous())
    if torch.cuda.is_available():
        for key, value in state.items():
            if key.startswith(CUDA_PREFIX):
                idx = int(key[len(CUDA_PREFIX) :])
                if idx < torch.cuda.device_count():
                    torch.cuda.set_rng_state(value.contiguous(), idx)


def derived_seed(source: RngState, rank: int) -> int:
    """The documented rule for ranks that did not exist when the checkpoint was saved: a 63-bit seed from
    sha256(saved rank-0 torch CPU state || rank). Deterministic, distinct per rank, and tied to the
    checkpoint, so a resumed run at a new world size is reproducible."""
    h = hashlib.sha256(source[TORCH_CPU].numpy().tobytes() + rank.to_bytes(8, "little")).digest()
    return int.from_bytes(h[:8], "little") >> 1


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)  # also seeds every CUDA device
