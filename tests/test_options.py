"""CheckpointManager's option objects: validated when built, and every moved keyword names its new home."""

from __future__ import annotations

import dataclasses
import inspect
import math
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

import safepoint
from safepoint.options import MOVED_KEYWORDS

OPTION_OBJECTS = (
    safepoint.WriterOptions,
    safepoint.PreemptionOptions,
    safepoint.ClusterOptions,
    safepoint.Keep,
)


@pytest.mark.parametrize("name", sorted(MOVED_KEYWORDS))
def test_a_moved_keyword_fails_naming_its_new_home(root: Path, name: str) -> None:
    with pytest.raises(TypeError) as e:
        safepoint.CheckpointManager(root, **{name: 1})
    assert f"{name}= moved" in str(e.value) and MOVED_KEYWORDS[name] in str(e.value)
    assert not root.exists()  # refused before anything was touched


def test_an_unknown_keyword_fails_as_python_would(root: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_lsat'"):
        safepoint.CheckpointManager(root, keep_lsat=3)


def test_every_moved_home_exists() -> None:
    homes = {"writer": safepoint.WriterOptions, "preemption": safepoint.PreemptionOptions}
    homes |= {"cluster": safepoint.ClusterOptions, "transfer": safepoint.TransferOptions}
    homes |= {"save_every_seconds": safepoint.AdaptiveInterval, "keep": safepoint.Keep}
    for home in MOVED_KEYWORDS.values():
        keyword, rest = home.split("=safepoint.", 1)
        cls_name, field = rest.split("(", 1)
        cls = homes[keyword]
        assert cls.__name__ == cls_name
        assert field.split("=")[0] in {f.name for f in dataclasses.fields(cls)}, home


@pytest.mark.parametrize("cls", OPTION_OBJECTS)
def test_option_objects_are_frozen_and_documented(cls: type) -> None:
    obj = cls()
    with pytest.raises(dataclasses.FrozenInstanceError):
        obj.__setattr__(dataclasses.fields(cls)[0].name, None)
    source = Path(sys.modules[cls.__module__].__file__ or "").read_text()
    for f in dataclasses.fields(cls):
        # each field is followed by its docstring
        assert f"{f.name}: " in source and '"""' in source.split(f"    {f.name}: ", 1)[1].split("\n")[1], (
            f.name
        )


@pytest.mark.parametrize(
    "build",
    [
        lambda: safepoint.WriterOptions(async_writer="fork"),
        lambda: safepoint.WriterOptions(if_busy="queue"),
        lambda: safepoint.WriterOptions(threads=0),
        lambda: safepoint.WriterOptions(threads=True),
        lambda: safepoint.PreemptionOptions(poll_interval_s=0),
        lambda: safepoint.PreemptionOptions(poll_interval_s=math.nan),
        lambda: safepoint.PreemptionOptions(poll="not callable"),
        lambda: safepoint.PreemptionOptions(exit_code=0),
        lambda: safepoint.PreemptionOptions(exit_code=256),
        lambda: safepoint.ClusterOptions(collective_timeout_s=0),
        lambda: safepoint.ClusterOptions(collective_timeout_s=math.inf),
        lambda: safepoint.ClusterOptions(lease_stale_after_s=-1),
        lambda: safepoint.ClusterOptions(lease_stale_after_s=math.nan),
        lambda: safepoint.ClusterOptions(background_deletes="yes"),  # type: ignore[arg-type]
        lambda: safepoint.AdaptiveInterval(mtbf_s=0),
    ],
)
def test_bad_option_values_fail_when_the_object_is_built(build: Any) -> None:
    with pytest.raises(ValueError):
        build()


def test_an_option_object_of_the_wrong_kind_is_refused_by_name(root: Path) -> None:
    with pytest.raises(TypeError, match=r"writer= takes a safepoint.WriterOptions, got dict"):
        safepoint.CheckpointManager(root, writer={"async_writer": "thread"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cluster= takes a safepoint.ClusterOptions, got WriterOptions"):
        safepoint.CheckpointManager(root, cluster=safepoint.WriterOptions())  # type: ignore[arg-type]


def test_options_reach_the_parts_they_configure(root: Path) -> None:
    with safepoint.CheckpointManager(
        root,
        async_save=True,
        writer=safepoint.WriterOptions(async_writer="thread", if_busy="skip", threads=2),
        cluster=safepoint.ClusterOptions(collective_timeout_s=42.0, lease_stale_after_s=60.0),
    ) as mgr:
        assert mgr._if_busy == "skip" and mgr._process is None
        assert mgr._saver.writer_threads == 2
        assert mgr.comm.timeout_s == 42.0
        assert mgr._lease.stale_after_s == 60.0


def test_the_manager_takes_at_most_15_parameters() -> None:
    params = inspect.signature(safepoint.CheckpointManager).parameters
    named = [p for p in params.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(named) <= 15, [p.name for p in named]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({"keep_last": 3}, "keep=safepoint.Keep(last=...)"),
        ({"keep_best": 2, "best_metric": "loss"}, "keep=safepoint.Keep(best=safepoint.KeepBest(n, metric="),
        ({"keep_local_last": 2}, "keep=safepoint.Keep(local_last=...)"),
        ({"preemption_signals": [signal.SIGTERM]}, "preemption=safepoint.PreemptionOptions(signals=[...])"),
        ({"grace_seconds": 30}, "preemption=safepoint.PreemptionOptions(grace_seconds=...)"),
    ],
)
def test_the_old_spellings_fail_showing_the_new_one(root: Path, old: dict[str, Any], new: str) -> None:
    with pytest.raises(TypeError) as e:
        safepoint.CheckpointManager(root, **old)
    assert new in str(e.value) and "\n" not in str(e.value)
    assert not root.exists()


def test_the_old_option_name_fails_naming_the_new_one() -> None:
    message = "safepoint.TransferConfig was renamed: use safepoint.TransferOptions"
    with pytest.raises(ImportError, match=message):
        safepoint.TransferConfig  # noqa: B018
    with pytest.raises(ImportError, match=message):
        from safepoint import TransferConfig  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'TransferConfg'"):
        safepoint.TransferConfg  # noqa: B018
    assert all(not name.endswith("Config") for name in safepoint.__all__)


def test_preemption_options_hold_the_signals_and_the_grace() -> None:
    options = safepoint.PreemptionOptions(signals=[signal.SIGTERM, 10, signal.SIGTERM], grace_seconds=30)
    assert options.signals == (signal.SIGTERM, signal.SIGUSR1) and options.grace_seconds == 30
    assert hash(options) == hash(safepoint.PreemptionOptions(signals=(15, 10), grace_seconds=30))
    for bad, match in [
        ({"signals": signal.SIGTERM}, "must be a list of signals"),
        ({"signals": ["TERM"]}, "'TERM' is not a signal"),
        ({"signals": [999]}, "999 is not a signal"),
        ({"signals": [signal.SIGKILL]}, "cannot be caught"),
        ({"grace_seconds": 0}, "grace_seconds must be a positive"),
        ({"grace_seconds": math.inf}, "grace_seconds must be a positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            safepoint.PreemptionOptions(**bad)
