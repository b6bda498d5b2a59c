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
        # Through NumPy: torch.tensor of a 625-int tuple costs ~7x more, on every save (issue 27), and
        # np.fromiter ~2/3 of np.array's time for it (no sequence inspection first). The one- and two-
        # element tensors too: torch.tensor of a short list ~7 us each, a NumPy array handed over ~2 us.
        PY_STATE: torch.from_numpy(np.fromiter(internal, dtype=np.int64, count=len(internal))),
        PY_GAUSS: torch.from_numpy(np.array([math.nan if gauss_next is None else gauss_next], np.float64)),
        NP_KEYS: torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
        NP_POS: torch.from_numpy(np.array([pos, has_gauss], dtype=np.int64)),
        NP_GAUSS: torch.from_numpy(np.array([cached], dtype=np.float64)),
        TORCH_CPU: torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        for i in range(torch.cuda.device_count()):
            state[f"{CUDA_PREFIX}{i}"] = torch.cuda.get_rng_state(i)
    return state


_U32 = 2**32 - 1
_MT_WORDS = 624  # the Mersenne Twister's state: 624 32-bit words, then a position in 0..624


def _tensor_problem(state: object, key: str, dtype: torch.dtype, numel: int | None) -> str | None:
    value = state.get(key) if isinstance(state, dict) else None
    if not isinstance(value, torch.Tensor):
        return f"{key} is a {type(value).__name__}, not a tensor"
    if value.dtype != dtype or value.dim() != 1 or (numel is not None and value.numel() != numel):
        return f"{key} is a {value.dtype} tensor of shape {tuple(value.shape)}, not {dtype} [{numel}]"
    return None


def rng_problem(state: object) -> str | None:
    """Why ``state`` is not an RNG state :func:`capture_rng` writes (types, shapes, ranges), or None.

    Checked when the rank file is read, before anything is loaded or applied: ``random.setstate`` of a
    forged word (-1, 2**32) raises OverflowError, NumPy's a ValueError, torch's a RuntimeError, after the
    tensors were already loaded in place; a state that fails here makes the checkpoint corrupt instead."""
    problem = (
        _tensor_problem(state, PY_STATE, torch.int64, _MT_WORDS + 1)
        or _tensor_problem(state, PY_GAUSS, torch.float64, 1)
        or _tensor_problem(state, NP_KEYS, torch.int64, _MT_WORDS)
        or _tensor_problem(state, NP_POS, torch.int64, 2)
        or _tensor_problem(state, NP_GAUSS, torch.float64, 1)
        or _tensor_problem(state, TORCH_CPU, torch.uint8, torch.get_rng_state().numel())
    )
    if problem is not None:
        return problem
    assert isinstance(state, dict)
    words, keys, pos = state[PY_STATE], state[NP_KEYS], state[NP_POS].tolist()
    if not (bool(((words[:-1] >= 0) & (words[:-1] <= _U32)).all()) and 0 <= int(words[-1]) <= _MT_WORDS):
        return f"{PY_STATE} holds words outside [0, 2**32) or a position outside [0, {_MT_WORDS}]"
    if not bool(((keys >= 0) & (keys <= _U32)).all()) or not (0 <= pos[0] <= _MT_WORDS and pos[1] in (0, 1)):
        return f"{NP_KEYS}/{NP_POS} hold words outside [0, 2**32) or a position outside [0, {_MT_WORDS}]"
    gauss = float(state[PY_GAUSS][0])
    if math.isinf(gauss) or not math.isfinite(float(state[NP_GAUSS][0])):
        return f"{PY_GAUSS}/{NP_GAUSS} are not finite"
    for key in state:
        if key.startswith(CUDA_PREFIX):
            suffix = key[len(CUDA_PREFIX) :]
            if not suffix.isdigit() or (problem := _tensor_problem(state, key, torch.uint8, None)):
                return problem or f"{key} is not a CUDA device's state"
        elif key not in (PY_STATE, PY_GAUSS, NP_KEYS, NP_POS, NP_GAUSS, TORCH_CPU):
            return f"unexpected entry {str(key)[:40]!r}"
    return None


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
