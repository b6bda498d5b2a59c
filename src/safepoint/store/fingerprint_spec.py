"""The constants of the device-side content fingerprint (store/fingerprint.py's module docstring specifies
the algorithm). One place for both implementations of it: the torch ops (fingerprint.py) and the fused
Triton kernel (fingerprint_triton.py) must compute bit-identical lane sums, since the manifest records the
digest and a GPU digest must equal the CPU digest of the same bytes."""

from __future__ import annotations

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
"""The position key's multiplier: ``k_i = fmix_a(i * GOLDEN + KEY_SEED)`` for the word at index ``i``."""
KEY_SEED = 0x243F6A8885A308D3
LANE_B = 0xD6E8FEB86659FD93
"""Lane B keys its word with ``k_i * LANE_B`` (lane A with ``k_i`` itself), so the lanes are independent."""
FMIX_A = (33, 0xFF51AFD7ED558CCD, 33, 0xC4CEB9FE1A85EC53, 33)
"""murmur3's fmix64: (shift, multiplier, shift, multiplier, shift)."""
FMIX_B = (30, 0xBF58476D1CE4E5B9, 27, 0x94D049BB133111EB, 31)
"""splitmix64's finalizer, in the same form."""
