"""A traceable wrapper tensor subclass, as torchao's NF4 and float8 tensors are: its values in an inner
tensor (``packed``), per-instance metadata (``meta``) in its flatten context. Restore's
``torch.load(weights_only=True)`` loads one only if its class is allowlisted and its metadata is plain."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map


class WrapperTensor(torch.Tensor):
    packed: torch.Tensor
    meta: Any

    @staticmethod
    def __new__(cls, inner: torch.Tensor, meta: Any) -> WrapperTensor:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor, meta: Any) -> None:
        self.packed, self.meta = inner, meta

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["packed"], self.meta

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any
    ) -> WrapperTensor:
        return cls(inner["packed"], meta)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        def unwrap(x: Any) -> Any:
            return x.packed if isinstance(x, WrapperTensor) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func in _REWRAPPED:  # as torchao's do: a detached or copied wrapper is a wrapper
            return type(args[0])(out, args[0].meta)
        return out


_REWRAPPED = {torch.ops.aten.detach.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default}
