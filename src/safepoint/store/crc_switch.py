"""torch.save's per-record CRC-32, off while safepoint writes.

torch.save's zip writer computes a CRC-32 of every record it writes. Inside safepoint's writer that is
redundant: our crc32c covers every byte of every file and is verified before anything is loaded, and the
CRC-32 cost more CPU than our crc32c (0.25 s per GiB here, about 8% of the save); with it off, a tensor's
zip head and tail no longer depend on its data, which is what lets item_writer write from a per-shape
template. Set ``SKIP_TORCH_CRC32 = False`` to keep torch's CRC-32 at that cost.

torch's switch (``torch.serialization.set_crc32_options``, read once per torch.save) is process-wide in some
torch versions and per thread in others (torch 2.13 keeps its serialization config in a ContextVar: a new
thread starts from the default, CRC-32 on). So every thread that writes enters ``torch_crc32_off`` itself,
and the switch handles both: a process-wide setting is turned off while at least one safepoint write runs
and put back when the last one ends; a per-thread setting that is still on in this thread is turned off
for this thread and put back when it leaves. The trade-off with a process-wide switch: a torch.save that
another thread of the same process runs meanwhile also writes its records with a zero CRC-32 field.
torch.load does not check that field and reads such files normally; only zip tools (``unzip -t``) flag them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

SKIP_TORCH_CRC32 = True
_crc_lock = threading.Lock()
_crc_users = 0
_crc_saved = True


def _get() -> bool:
    return bool(torch.serialization.get_crc32_options())


@contextmanager
def torch_crc32_off() -> Iterator[None]:
    """Turn torch.save's per-record CRC-32 off for the duration, in this thread (nested and concurrent uses
    count)."""
    global _crc_users, _crc_saved
    if not SKIP_TORCH_CRC32:
        yield
        return
    with _crc_lock:
        if _crc_users == 0:
            _crc_saved = _get()
            torch.serialization.set_crc32_options(False)
        _crc_users += 1
    # A per-thread setting: the first user above turned off only its own thread's.
    local = _get()
    if local:
        torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        if local:
            torch.serialization.set_crc32_options(True)
        with _crc_lock:
            _crc_users -= 1
            # The last writer out restores the previous setting; if someone turned it back on meanwhile,
            # their choice stands.
            if _crc_users == 0 and not _get():
                torch.serialization.set_crc32_options(_crc_saved)
