"""CheckpointManager's option objects: validated when built, and every moved keyword names its new home."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

import safepoint
from safepoint.options import MOVED_KEYWORDS

OPTION_OBJECTS = (safepoint.WriterOptions, safepoint.PreemptionOptions, safepoint.ClusterOptions)


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
    homes |= {"cluster": safepoint.ClusterOptions, "transfer": safepoint.TransferConfig}
    homes |= {"save_every_seconds": safepoint.AdaptiveInterval}
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
    source = Path(safepoint.options.__file__).read_text()
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
