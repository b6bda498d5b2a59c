"""The manifest's text (store/manifest.py ``_indented``): what ``json.dumps(indent=1, sort_keys=True,
allow_nan=False)`` writes, built without json's pure-Python encoder (issue 27: ~0.2 ms of every commit)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import safepoint
from safepoint.store import manifest as manifest_module


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"a": []},
        {"b": {"x": 1, "a": [1, 2.5, 'é\n"', None, True, False, {}, []]}, "a": -0.0},
        {"nested": [[[]], [{}], {"k": [{"z": 1e300, "y": 1e-300, "x": 3}]}]},
        {"tuple": (1, 2)},  # json writes a tuple as a list: left to json
        {"big": 2**70, "neg": -5, "s": "\u2028\udc80"},
        {"enum": safepoint.Keep},  # not JSON: json's own TypeError
        {"nan": math.nan},  # json's own ValueError
        {1: "a non-str key"},  # json converts it: left to json
        {"sub": type("S", (str,), {"__str__": lambda self: "y"})("x")},  # as torch.__version__
    ],
)
def test_the_manifest_text_is_json_dumps_own(value: Any) -> None:
    """store/manifest.py writes its manifest with a fast encoder of its own (json's indent=1 runs the
    pure-Python encoder): the very text json.dumps(indent=1, sort_keys=True, allow_nan=False) gives, and
    json's own error where json raises one."""
    try:
        expected = json.dumps(value, indent=1, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        with pytest.raises(type(e)):
            manifest_module._indented(value)
        return
    assert manifest_module._indented(value) == expected


def test_a_saved_manifest_is_the_json_of_its_body(root: Path) -> None:
    with safepoint.CheckpointManager(root) as mgr:
        mgr.save(1, safepoint.TrainState(model=torch.nn.Linear(2, 2)), metrics={"loss": 0.5})
    raw = (root / "step-1" / "safepoint.json").read_bytes()
    assert raw == (json.dumps(json.loads(raw), indent=1, sort_keys=True, allow_nan=False) + "\n").encode()
