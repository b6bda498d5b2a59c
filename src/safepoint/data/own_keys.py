"""A loaded value written into a state at DCP's object path, at the state's own dict keys.

DCP's flattening names every dict key ``str(key)`` in its object paths, and its ``set_element`` writes
along such a path as it is: into a dict keyed by ints (``{3: 4}`` in ``extra``, a ``Stateful`` object's
``{0: ..., 1: ...}``) the loaded value went beside the key, at ``"3"``, and the state kept its stale value
at ``3``, which is what its ``load_state_dict`` then read. :func:`set_at` writes at the key the state
already has whose ``str`` is the path's name; anything else as ``set_element`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def set_at(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """``set_element(root, path, value)``, each dict key resolved to ``root``'s own (see the docstring)."""
    here: Any = root
    for i, key in enumerate(path):
        if isinstance(here, Mapping):
            if key not in here:  # a key the dict holds as another type (an int), named by its str
                key = _own_key(here, key)
        else:  # a list, as set_element: extended with None up to the index
            here.extend([None] * (key + 1 - len(here)))
        if i == len(path) - 1:
            here[key] = value
            return
        if (here.get(key) if isinstance(here, Mapping) else here[key]) is None:
            here[key] = {} if type(path[i + 1]) is str else []  # as set_element creates a missing one
        here = here[key]


def _own_key(here: Mapping[Any, Any], key: Any) -> Any:
    """The key of ``here`` whose ``str`` is ``key``: an int by a lookup (a template-free optimizer's state
    has one per parameter, each value written at its own: no scan per value), any other type by a scan."""
    if isinstance(key, str):
        try:
            number = int(key)
        except ValueError:
            pass
        else:
            if str(number) == key and number in here:
                return number
    return next((k for k in here if not isinstance(k, str) and str(k) == key), key)
