"""The host allocator's thresholds, fixed at start-up so a step's page faults do not depend on the
process's allocation history.

glibc's malloc serves a request above ``M_MMAP_THRESHOLD`` (128 KiB at start) with a fresh
``mmap``, and returns the free top of a heap to the OS once it exceeds ``M_TRIM_THRESHOLD``
(also 128 KiB at start). Both move: freeing an mmapped chunk raises the mmap threshold to that
chunk's size, up to 32 MiB on 64-bit Linux, and the trim threshold to twice that. A training step
that allocates and frees megabytes of activations every micro-batch therefore page-faults them
in again every step or not at all, depending on the largest chunk the process happened to free
before. Measured on the CPU benchmark model (2 ranks, DDP, micro-batch 8): 3,300 minor page
faults per rank per step in memtrain and about 1,500 in a plain Accelerate loop of the same
model; 60 in memtrain with the thresholds fixed (and 61 when, instead, one 30 MiB tensor was
freed at start-up, which moves glibc's own thresholds to their ceiling) — and the step time
follows (``benchmarks/overhead.py``).

:func:`fix_thresholds` sets both thresholds to where glibc's own rule would end
(``mallopt(M_MMAP_THRESHOLD, 32 MiB)``, ``mallopt(M_TRIM_THRESHOLD, 64 MiB)``): each malloc
arena keeps up to 64 MiB free at its top instead of returning it, and requests from 128 KiB to
32 MiB come from the heap instead of fresh mappings, so a process may hold more host memory than
before (the CPU ``peak_memory_bytes``, the resident set, includes it). Source: glibc
``mallopt(3)`` (``DEFAULT_MMAP_THRESHOLD_MAX``); the same problem is why PyTorch's CPU launcher
(``torch.backends.xeon.run_cpu``) preloads jemalloc with memory return turned off in its settings.

What a heap keeps is memory the plan does not count. On a CPU run the host is the device: its
activations, gathered blocks and gradients are host allocations of megabytes every micro-batch,
and with the thresholds at 32 / 64 MiB the heaps keep what each step freed, fragmented across the
step's allocations — on a 25M-parameter GPT-2 under FSDP2 (2 ranks, optimizer offload at 50%) the
heaps held 1,054 MiB for 402 MiB of live blocks, and the resident peak was 45% above the host
bytes the run planned. So a CPU run fixes both thresholds at glibc's starting values instead
(:func:`policy`; :func:`fix_thresholds` with ``return_freed``: 128 KiB,
``DEFAULT_MMAP_THRESHOLD_MIN`` and ``DEFAULT_TRIM_THRESHOLD``), where they no longer move: a
freed activation goes back to the OS and the resident set follows the live bytes the accounting
predicts (the same run: heaps of 149 MiB, resident peak 3% above the plan;
``benchmarks/placement_accuracy.py`` for every placement). The price is the page faults the
32 MiB setting avoids (that run's step: 2.3 s instead of 1.2 s); ``memory.host_allocator_thresholds
true`` takes the speed and gives up the host plan's hold on the resident set. A GPU run's host
holds no activations and keeps the 32 / 64 MiB setting.
"""

from __future__ import annotations

import ctypes
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
RETURN_THRESHOLD_BYTES = 128 * 2**10
"""glibc's starting mmap and trim thresholds (``DEFAULT_MMAP_THRESHOLD_MIN``,
``DEFAULT_TRIM_THRESHOLD``), fixed where a freed block must go back to the OS."""

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
"""The variables by which a user sets these thresholds themselves (any of them also stops glibc's
dynamic rule)."""
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def glibc_version() -> Optional[str]:
    """This process's C library if it is glibc (e.g. ``"glibc 2.36"``), else None (musl, macOS, …)."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    return version if version and version.startswith("glibc") else None


def reason_to_leave(environ: Mapping[str, str], platform: str = sys.platform,
                    libc: Optional[str] = "detect") -> Optional[str]:
    """Why the thresholds are left as they are, or None to set them: not glibc, or the user chose
    (one of :data:`_USER_SETTINGS`, a ``glibc.malloc`` tunable, another allocator in ``LD_PRELOAD``).

    Args:
        environ: the environment to read the user's choices from.
        platform: ``sys.platform``; libc: this process's C library (:func:`glibc_version`; None =
            not glibc; ``"detect"`` = ask).
    """
    if libc == "detect":
        libc = glibc_version()
    if not platform.startswith("linux") or libc is None:
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


def policy(setting: Optional[bool], owns_process: bool, cpu_run: bool) -> tuple[bool, bool]:
    """``(enabled, return_freed)`` for :func:`fix_thresholds` from ``memory.host_allocator_thresholds``.

    Args:
        setting: null = memtrain decides: a CPU run returns freed memory (128 KiB) in any process,
            for its plan to hold; a GPU run's 32 / 64 MiB only where memtrain owns the process (the
            ``memtrain`` command: glibc cannot read back or undo them in a user's). True: the
            32 / 64 MiB speed setting on any run; False: glibc left alone.
        owns_process: the ``memtrain`` command runs (not ``memtrain.Trainer`` in a user's process).
        cpu_run: the run's device is the CPU (its activations are host memory).
    """
    if setting is None:
        return owns_process or cpu_run, cpu_run
    return setting, False


def threshold_bytes(return_freed: bool) -> tuple[int, int]:
    """``(mmap, trim)`` thresholds in bytes :func:`fix_thresholds` sets: :data:`RETURN_THRESHOLD_BYTES`
    for both with ``return_freed``, else :data:`MMAP_THRESHOLD_BYTES` / :data:`TRIM_THRESHOLD_BYTES`."""
    return (RETURN_THRESHOLD_BYTES, RETURN_THRESHOLD_BYTES) if return_freed else (MMAP_THRESHOLD_BYTES,
                                                                                 TRIM_THRESHOLD_BYTES)


def fix_thresholds(enabled: bool = True, environ: Optional[Mapping[str, str]] = None,
                   return_freed: bool = False) -> Optional[dict[str, int]]:
    """Set glibc's mmap and trim thresholds (``memory.host_allocator_thresholds``) for this process.

    Args:
        enabled: False = leave the allocator alone.
        environ: the environment to read the user's own choices from (default ``os.environ``).
        return_freed: fix both at :data:`RETURN_THRESHOLD_BYTES` (freed blocks go back to the OS:
            a CPU run, :func:`policy`) instead of :data:`MMAP_THRESHOLD_BYTES` /
            :data:`TRIM_THRESHOLD_BYTES` (freed blocks stay for the next micro-batch).

    Returns:
        ``{"mmap_threshold_bytes": …, "trim_threshold_bytes": …}`` when set; None when left alone
        (disabled, not glibc, the user chose, or ``mallopt`` refused). Never raises.
    """
    if not enabled:
        return None
    reason = reason_to_leave(os.environ if environ is None else environ)
    mmap_bytes, trim_bytes = threshold_bytes(return_freed)
    if reason is None:
        try:
            libc = ctypes.CDLL(None)  # the process's own symbols: glibc's malloc is the one in use
            if not libc.mallopt(M_MMAP_THRESHOLD, mmap_bytes):
                reason = "mallopt refused the mmap threshold"
            elif not libc.mallopt(M_TRIM_THRESHOLD, trim_bytes):
                reason = "mallopt refused the trim threshold (the mmap threshold is set)"
        except (OSError, AttributeError) as exc:
            reason = f"no mallopt ({exc})"
    if reason is not None:
        log.debug("memtrain: host allocator thresholds left as they are: %s", reason)
        return None
    return {"mmap_threshold_bytes": mmap_bytes, "trim_threshold_bytes": trim_bytes}
