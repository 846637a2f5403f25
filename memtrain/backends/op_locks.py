"""Stale locks of DeepSpeed's op builds: found before DeepSpeed waits on them forever.

DeepSpeed builds an op it was not installed with (``cpu_adam``, ``shm_comm``: its CPU
collectives) the first time a run needs it, through torch's JIT extension loader. The loader
creates ``<build folder>/lock`` before it compiles and deletes it after; every other process that
needs the op meanwhile polls until the lock is gone (``torch.utils.file_baton.FileBaton``), with no
time limit. A build stopped half-way (Ctrl-C, a kill, a time limit) leaves the lock, and every later
run on the machine then waits in ``deepspeed.initialize`` forever.

A lock is stale when no process holds it open (torch's ``FileBaton`` keeps the lock's file
descriptor from taking it to releasing it), no process works in its build folder (the compiler and
``ninja`` run there) and neither it nor any file beside it changed for :data:`LOCK_GRACE_S`: a build
that is under way holds its lock open and has its compiler running, and the moments between
(writing the build file before the compiler starts, loading the op after it ends) have just written
a file there.

Two runs starting together (two ranks' first runs, two jobs on one machine) may both find the
same stale lock; the second must not remove the lock a third process took in between. Removing is
therefore done under an exclusive ``flock`` on the build folder, with the lock judged again inside.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from typing import Iterable, Optional

import psutil

from memtrain.memory.machine import deepspeed_op_folders

log = logging.getLogger("memtrain")

JIT_BUILDERS = ("CPUAdamBuilder", "ShareMemCommBuilder", "FusedAdamBuilder")
"""The DeepSpeed ops a memtrain run may build the first time it needs them (CPU Adam for offload,
the CPU collectives, the fused GPU Adam)."""
LOCK_GRACE_S = 120.0
"""Seconds since the last change in a build folder for which its lock, with no process working
there, is still taken for a build starting up or loading what it built."""


def _working_dirs() -> list[str]:
    """The working folders of this machine's processes that can be read."""
    dirs = []
    for proc in psutil.process_iter(["cwd"]):
        cwd = proc.info.get("cwd")
        if cwd:
            dirs.append(cwd)
    return dirs


def _open_files() -> list[str]:
    """The paths of the regular files this machine's processes hold open, those that can be read."""
    paths = []
    for proc in psutil.process_iter(["open_files"]):
        paths += [f.path for f in proc.info.get("open_files") or []]
    return paths


def stale_lock(folder: str, grace_s: float = LOCK_GRACE_S) -> Optional[str]:
    """The path of ``folder``'s build lock if it is stale, else None (no lock, or a build holds it).

    Args:
        folder: an op's build folder (:func:`memtrain.memory.machine.deepspeed_op_folders`).
        grace_s: :data:`LOCK_GRACE_S`, or 0 where the caller has just ended the builder itself
            (``benchmarks/gpu_suite.py`` after killing a step at its time limit).
    """
    lock = os.path.join(folder, "lock")
    try:
        changed = max(os.stat(os.path.join(folder, name)).st_mtime for name in os.listdir(folder))
    except (OSError, ValueError):  # no lock (or the folder went)
        return None
    if not os.path.exists(lock) or time.time() - changed < grace_s:
        return None
    inside = os.path.realpath(folder)
    for cwd in _working_dirs():
        if os.path.realpath(cwd) == inside or os.path.realpath(cwd).startswith(inside + os.sep):
            return None  # a compiler works there: the build is alive
    real_lock = os.path.realpath(lock)
    if any(os.path.realpath(path) == real_lock for path in _open_files()):
        return None  # a loader holds it between taking and releasing it
    return lock


def remove_stale_lock(folder: str, grace_s: float = LOCK_GRACE_S) -> Optional[str]:
    """Remove ``folder``'s build lock if it is stale (:func:`stale_lock`), judged and removed under
    an exclusive ``flock`` on ``folder`` so that one cleaner at a time does it: a lock another
    process took after a second cleaner removed the stale one is left alone. torch's loader does not
    take that ``flock``, so a build is never held up by it. Returns the lock removed, or None.

    Raises:
        OSError: the stale lock could not be removed (its folder is not writable).
    """
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # the folder went: no lock to judge
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        lock = stale_lock(folder, grace_s=grace_s)
        if lock is not None:
            os.remove(lock)
        return lock
    finally:
        os.close(fd)  # closing releases the flock


def clear_stale_locks(builder_names: Iterable[str], grace_s: float = LOCK_GRACE_S) -> list[str]:
    """Remove the stale build locks (:func:`remove_stale_lock`, with ``grace_s``) of the DeepSpeed ops
    ``builder_names`` (e.g. ``ShareMemCommBuilder``, ``CPUAdamBuilder``), each named in a warning;
    a lock that cannot be removed is named with the command that removes it. Returns the locks
    removed. Called by global rank 0 before ``deepspeed.initialize``."""
    removed = []
    for name in builder_names:
        for folder in deepspeed_op_folders(name) or []:
            try:
                lock = remove_stale_lock(folder, grace_s=grace_s)
            except OSError as exc:
                lock = os.path.join(folder, "lock")
                log.warning("memtrain: %s is left by a DeepSpeed op build that was stopped (no process builds in "
                            "%s); DeepSpeed will wait on it forever: remove it with `rm %s` (%s)", lock, folder,
                            lock, exc.strerror)
                continue
            if lock is None:
                continue
            log.warning("memtrain: removed %s, left by a DeepSpeed op build that was stopped (no process builds "
                        "in its folder); DeepSpeed builds the op again where that build did not finish", lock)
            removed.append(lock)
    return removed
