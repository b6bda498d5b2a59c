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
_per_thread: bool | None = None  # whether torch's switch is per thread; found out at the first use
_tls = threading.local()  # this thread's nesting depth and its own setting before (per-thread switch)


def _get() -> bool:
    return bool(torch.serialization.get_crc32_options())


def _switch_is_per_thread() -> bool:
    """Called by the first user, right after it turned the switch off: a fresh thread that still reads
    "on" sees a switch of its own (torch 2.13's ContextVar config); one that reads "off" shares ours."""
    seen: list[bool] = []
    probe = threading.Thread(target=lambda: seen.append(_get()), name="safepoint-crc-probe")
    probe.start()
    probe.join()
    return bool(seen and seen[0])


@contextmanager
def torch_crc32_off() -> Iterator[None]:
    """Turn torch.save's per-record CRC-32 off for the duration, in this thread (nested and concurrent uses
    count)."""
    global _crc_users, _crc_saved, _per_thread
    if not SKIP_TORCH_CRC32:
        yield
        return
    depth = getattr(_tls, "depth", 0)
    if depth == 0:
        with _crc_lock:
            own = _get()
            if _crc_users == 0:
                _crc_saved = own
            torch.serialization.set_crc32_options(False)
            if _per_thread is None:
                _per_thread = _switch_is_per_thread()
            _crc_users += 1
        _tls.own = own
    _tls.depth = depth + 1
    try:
        yield
    finally:
        _tls.depth -= 1
        if _tls.depth == 0:
            with _crc_lock:
                _crc_users -= 1
                if _per_thread:
                    torch.serialization.set_crc32_options(_tls.own)  # this thread's own setting back
                elif _crc_users == 0 and not _get():
                    # A process-wide switch: the last writer out restores the previous setting; if someone
                    # turned it back on meanwhile, their choice stands.
                    torch.serialization.set_crc32_options(_crc_saved)
