"""Differential campaign: an async save restores exactly what a sync save of the same state restores.

Hypothesis draws nested states (dicts, lists, tuples, a namedtuple, OrderedDicts and defaultdicts, in any
nesting) of tensors of several dtypes (bf16, bool, int8, complex64 among them; 0-d, empty, transposed,
strided, sliced and conj views; the same tensor or Parameter twice, views of one storage side by side;
Parameters with and without ``requires_grad``) and plain values (ints, floats with NaN payloads, strings,
bytes, None). Each state is saved once sync and once async (the thread writer and the process writer, the
default), through the public manager, and each checkpoint restored into a fresh state of the same shape:
the restores must be the same down to the bits (``tests/helpers/fidelity.canon``: types, dtypes, shapes,
strides, storage offsets and sharing, ties, ``requires_grad``, every byte of every storage). A state the
sync save refuses (a defaultdict inside a pickled value: restore could not load it) the async save must
refuse too, with the same error.

The managers live for the whole campaign and every example saves the next step with them, so an example
of the structure of the one before it reuses that one's staging buffers (the plan's ``fits``/``refit``):
the buffers of a reused plan are checked too. The short campaign runs by default (derandomized: the same
inputs every run); ``-m slow`` runs a long one.
"""

from __future__ import annotations

import itertools
import struct
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import safepoint
from safepoint.errors import CheckpointError, SaveError
from tests.helpers.fidelity import canon
from tests.helpers.holder import Holder

Pair = namedtuple("Pair", "a b")  # allowlisted for the restore's weights_only load while the test runs

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.bool, torch.int8, torch.int64,
          torch.uint8, torch.complex64]  # fmt: skip
SHAPES = [(), (0,), (5,), (2, 3), (4, 5), (4, 5), (3, 0)]
VIEWS = ["self", "t", "step", "tail", "row", "empty", "conj"]
WRAPS = ["plain", "plain", "param", "frozen", "grad"]
KINDS = ["dict", "dict", "list", "list", "tuple", "tuple", "pair", "odict", "ddict"]
MODES = ("sync", "thread", "process")


def _nan(payload: int) -> float:
    return float(struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000000 | payload))[0])


floats = st.one_of(st.floats(allow_nan=True), st.integers(1, 2**52 - 1).map(_nan))
scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1), floats, st.text(max_size=3), st.binary(max_size=3), st.none(),
    st.booleans(),
).map(lambda v: ("scalar", v))  # fmt: skip
# Two storages only, so that a drawn state often holds one tensor twice or two views of one storage.
tensors = st.tuples(st.just("tensor"), st.integers(0, 1), st.sampled_from(VIEWS), st.sampled_from(WRAPS))
keys = st.sampled_from("abcde")


def _containers(children: Any) -> Any:
    entries = st.lists(st.tuples(keys, children), max_size=3, unique_by=lambda kv: kv[0])
    return st.one_of(
        st.tuples(st.sampled_from(KINDS), st.lists(children, max_size=3), entries),
    ).map(lambda k: (k[0], k[2] if "dict" in k[0] else k[1][:2] if k[0] == "pair" else k[1]))


trees = st.recursive(scalars | tensors, _containers, max_leaves=10)
bases = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.sampled_from(SHAPES), st.integers(0, 2**16)), min_size=2, max_size=2
)
tops = st.lists(st.tuples(keys, trees), min_size=1, max_size=4, unique_by=lambda kv: kv[0])
states = st.tuples(bases, tops)
# For the gathered copy: storages with bytes in them (it packs two or more non-empty buffers, not fewer).
full_bases = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.sampled_from(SHAPES[2:5]), st.integers(0, 2**16)),
    min_size=2,
    max_size=2,
)
full_trees = st.recursive(tensors | tensors | scalars, _containers, max_leaves=10)
full_states = st.tuples(
    full_bases, st.lists(st.tuples(keys, full_trees), min_size=3, max_size=5, unique_by=lambda kv: kv[0])
)


def _base(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes as ``dtype``: NaNs with any payload, infinities, subnormals, both zeros."""
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if dtype is torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def _view(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "t" and t.dim() >= 2:
        return t.t()
    if how == "step" and t.dim() >= 1:
        return t[::2]
    if how == "tail" and t.dim() >= 1:
        return t[1:]
    if how == "row" and t.dim() >= 1 and len(t) > 0:
        return t[-1]
    if how == "empty" and t.dim() >= 1:
        return t[1:1]
    if how == "conj" and t.is_complex():
        return t.conj()
    return t


def _wrap(t: torch.Tensor, how: str) -> torch.Tensor:
    grads = t.is_floating_point() or t.is_complex()
    if how == "plain" or t.is_conj():
        return t
    if how == "grad":
        return t.detach().requires_grad_() if grads else t
    return torch.nn.Parameter(t, requires_grad=how == "param" and grads)


def build(spec: Any) -> dict[str, Any]:
    """A fresh live state from ``spec``: equal specs build states that are the same, ties included."""
    base_specs, top = spec
    made: dict[tuple[Any, ...], Any] = {}
    roots = [_base(*b) for b in base_specs]

    def go(node: Any) -> Any:
        kind, *rest = node
        if kind == "scalar":
            return rest[0]
        if kind == "tensor":
            b, view, wrap = rest
            if (b, view, wrap) not in made:  # the same spec leaf twice: the same tensor object (a tie)
                made[(b, view, wrap)] = _wrap(_view(roots[b], view), wrap)
            return made[(b, view, wrap)]
        items = rest[0]
        if kind == "dict":
            return {k: go(v) for k, v in items}
        if kind == "odict":
            return OrderedDict((k, go(v)) for k, v in items)
        if kind == "ddict":
            return defaultdict(list, {k: go(v) for k, v in items})
        if kind == "pair":
            return Pair(*(go(v) for v in items), *[None] * (2 - len(items)))
        seq = [go(v) for v in items]
        return seq if kind == "list" else tuple(seq)

    return {k: go(v) for k, v in top}


def _flattened(v: Any) -> Iterator[torch.Tensor]:
    """The tensors DCP stores as tensors (the others are inside a value it pickles whole)."""
    if isinstance(v, Mapping):
        for x in v.values():
            yield from _flattened(x)
    elif isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, list) and any(isinstance(x, (torch.Tensor, Mapping, list)) for x in v):
        for x in v:
            yield from _flattened(x)


def template(spec: Any) -> dict[str, Any]:
    """A state of ``spec``'s shape to restore into, none of its tensors holding the saved values."""
    out = build(spec)
    with torch.no_grad():
        for t in _flattened(out):
            t.zero_()
    return out


def save_then_restore(mgr: safepoint.CheckpointManager, step: int, spec: Any) -> Any:
    """``("saved", canon(restored))``; ``("refused", message)`` where the save raised a SaveError;
    ``("unrestorable", error type)`` where the restore of what was saved raised: never accepted, a committed
    checkpoint must restore (an empty dict in a list was so until tests/restore/test_empty_container_in_list.py)."""
    try:
        mgr.save(step, safepoint.TrainState(objects={"o": Holder(build(spec))}, rng=False))
        mgr.wait()
    except SaveError as e:
        return ("refused", str(e))
    back = Holder(template(spec))
    try:
        assert mgr.restore(safepoint.TrainState(objects={"o": back}, rng=False), step=step) == step
    except CheckpointError as e:
        return ("unrestorable", type(e).__name__)
    return ("saved", canon(back.v))


@pytest.fixture(scope="module")
def managers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, safepoint.CheckpointManager]]:
    """A sync manager and an async one per writer, each on a root of its own, for every campaign of the
    module (one writer process to start)."""
    tmp_path = tmp_path_factory.mktemp("differential")
    mgrs = {
        mode: safepoint.CheckpointManager(
            tmp_path / mode,
            async_save=mode != "sync",
            writer=safepoint.WriterOptions(async_writer="thread" if mode == "sync" else mode),
        )
        for mode in MODES
    }
    try:
        process = mgrs["process"]._process
        assert process is not None
        process.wait_ready()  # the process writes every save, not the thread while it starts
        with torch.serialization.safe_globals([Pair]):
            yield mgrs
    finally:
        for mgr in mgrs.values():
            mgr.close()


CAMPAIGN = settings(
    max_examples=12,  # the default suite's share (a few seconds); the long campaign is -m slow
    deadline=None,
    derandomize=True,  # the same inputs every run: never flaky
    suppress_health_check=list(HealthCheck),
    database=None,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
)
_steps = itertools.count(1)


def _campaign(mgrs: dict[str, safepoint.CheckpointManager], spec: Any) -> None:
    step = next(_steps)
    got = {mode: save_then_restore(mgr, step, spec) for mode, mgr in mgrs.items()}
    assert not [mode for mode, (kind, _) in got.items() if kind == "unrestorable"], got
    assert got["thread"] == got["sync"]
    assert got["process"] == got["sync"]


_F32, _BF16 = (torch.float32, (4, 5), 7), (torch.bfloat16, (2, 3), 8)
# The differences the campaign is here for, each once whatever it draws: a tensor and a Parameter twice in
# a tuple, views of one storage in a tuple (transposed, strided, rows, empty, conj), and in a list of tuples
# (pickled whole as well).
_EXAMPLES = [
    ([_F32, _BF16], [("a", ("tuple", [("tensor", 0, "self", "plain"), ("tensor", 0, "self", "plain"),
                                      ("tensor", 1, "t", "param"), ("tensor", 1, "t", "param")]))]),
    ([_F32, (torch.complex64, (5,), 9)], [("a", ("tuple", [
        ("tensor", 0, "t", "plain"), ("tensor", 0, "step", "grad"), ("tensor", 0, "row", "frozen"),
        ("tensor", 0, "empty", "plain"), ("tensor", 1, "conj", "plain"), ("tensor", 1, "tail", "plain")]))]),
    ([_F32, _BF16], [("a", ("list", [("tuple", [("tensor", 0, "row", "plain")]),
                                     ("tuple", [("tensor", 0, "tail", "plain"), ("scalar", _nan(5))])]))]),
]  # fmt: skip


@CAMPAIGN
@given(spec=states)
@example(spec=_EXAMPLES[0])
@example(spec=_EXAMPLES[1])
@example(spec=_EXAMPLES[2])
def test_async_restores_what_sync_restores(
    managers: dict[str, safepoint.CheckpointManager], spec: Any
) -> None:
    _campaign(managers, spec)


@settings(CAMPAIGN, max_examples=6)
@given(spec=full_states)
@example(spec=_EXAMPLES[0])
@example(spec=_EXAMPLES[1])
def test_the_same_with_the_gathered_copy(
    managers: dict[str, safepoint.CheckpointManager], gather_on_cpu: None, spec: Any
) -> None:
    _campaign(managers, spec)
    if spec in _EXAMPLES:  # two storages with bytes: their buffers are gathered, with both writers
        assert all(managers[mode]._stager.gathered == 2 for mode in ("thread", "process"))


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(CAMPAIGN, max_examples=400)
@given(spec=states)
def test_async_restores_what_sync_restores_long(
    managers: dict[str, safepoint.CheckpointManager], spec: Any
) -> None:
    _campaign(managers, spec)
