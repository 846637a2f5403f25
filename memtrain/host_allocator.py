"""The host allocator's thresholds, fixed at start-up so a step's page faults do not depend on the
process's allocation history.

glibc's malloc serves a request above ``M_MMAP_THRESHOLD`` (128 KiB at start) with a fresh
``mmap``, and returns the free top of its heap to the OS once it exceeds ``M_TRIM_THRESHOLD``
(twice the former). Both move: freeing an mmapped chunk raises the mmap threshold to that
chunk's size, up to 32 MiB on 64-bit Linux, and the trim threshold with it. A training step that
allocates and frees megabytes of activations every micro-batch therefore page-faults them in
again every step or not at all, depending on the largest chunk the process happened to free
before. Measured on the CPU benchmark model (2 ranks, DDP, micro-batch 8): 3,300 minor page
faults per rank per step in memtrain and about 1,500 in a plain Accelerate loop of the same
model, 61 in memtrain after one 30 MiB tensor was freed at start-up — and the step time follows
(``benchmarks/overhead.py``).

:func:`fix_thresholds` sets both thresholds to where glibc's own rule would end
(``mallopt(M_MMAP_THRESHOLD, 32 MiB)``, ``mallopt(M_TRIM_THRESHOLD, 64 MiB)``), so each process
keeps at most 64 MiB of freed heap instead of faulting it in again. Source: glibc ``mallopt(3)``
(``DEFAULT_MMAP_THRESHOLD_MAX``); the same problem is why PyTorch's CPU launcher
(``torch.backends.xeon.run_cpu``) preloads jemalloc or tcmalloc with memory return turned off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from typing import Mapping, Optional

log = logging.getLogger("memtrain")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20
"""glibc's ceiling for its dynamic mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``)."""
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
"""What glibc's dynamic rule sets the trim threshold to at that ceiling."""

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def reason_to_leave(environ: Mapping[str, str], platform: str = sys.platform) -> Optional[str]:
    """Why the thresholds are left as they are, or None to set them: not Linux, or the user chose
    (``MALLOC_*`` variables, a ``glibc.malloc`` tunable, another allocator in ``LD_PRELOAD``)."""
    if not platform.startswith("linux"):
        return f"not glibc ({platform})"
    chosen = [k for k in _USER_SETTINGS if k in environ]
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return f"set by the environment ({', '.join(chosen)})"
    preloaded = [a for a in _OTHER_ALLOCATORS if a in environ.get("LD_PRELOAD", "")]
    if preloaded:
        return f"another allocator is preloaded ({preloaded[0]})"
    return None


def fix_thresholds(enabled: bool = True, environ: Optional[Mapping[str, str]] = None) -> Optional[dict[str, int]]:
    """Set glibc's mmap and trim thresholds (``memory.host_allocator_thresholds``) for this process.

    Args:
        enabled: False = leave the allocator alone.
        environ: the environment to read the user's own choices from (default ``os.environ``).

    Returns:
        ``{"mmap_threshold_bytes": …, "trim_threshold_bytes": …}`` when set; None when left alone
        (disabled, not glibc, the user chose, or ``mallopt`` refused). Never raises.
    """
    if not enabled:
        return None
    reason = reason_to_leave(os.environ if environ is None else environ)
    if reason is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and libc.mallopt(M_TRIM_THRESHOLD,
                                                                                      TRIM_THRESHOLD_BYTES)
            reason = None if ok else "mallopt refused"
        except (OSError, AttributeError) as exc:
            reason = f"no mallopt ({exc})"
    if reason is not None:
        log.debug("memtrain: host allocator thresholds left as they are: %s", reason)
        return None
    return {"mmap_threshold_bytes": MMAP_THRESHOLD_BYTES, "trim_threshold_bytes": TRIM_THRESHOLD_BYTES}
