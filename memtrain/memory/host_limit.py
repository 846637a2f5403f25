"""The host memory a run's processes may really use: the smallest of the limits that bind them.

``psutil.virtual_memory().available`` is the machine's free memory, and a process is often held
to less: a container's or a batch scheduler's memory cgroup (v1 ``memory.limit_in_bytes``, v2
``memory.max``; the kernel's OOM killer ends the process past it, with SIGKILL and no message),
or a per-process resource limit (``RLIMIT_DATA``, ``RLIMIT_AS``: past it an allocation fails, and
torch's CPU allocator raises ``DefaultCPUAllocator: can't allocate memory``). :func:`host_limit`
takes the smallest of these, of the available memory and of ``memory.host_memory_gib``, and names
the one it took, so the planner plans for the memory that is there and ``memtrain plan`` and a
run's first line say which limit that was.

Every figure is in the units the planner compares with predicted peaks: bytes the ranks'
processes may hold together, what they hold now included. A cgroup is shared by the processes in
it; a resource limit binds each process alone (each rank has its own, inherited from the
launcher), so ``ranks`` processes may hold ``ranks`` times one process's room. How far a process is
from its resource limit is read from what the kernel compares with it (``VmData`` for
``RLIMIT_DATA``, ``VmSize`` for ``RLIMIT_AS``, in ``/proc/self/status``), not from its resident set.
Reclaimable page cache (the cgroup's inactive file pages) does not count as used, as in
``docker stats``.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass
from typing import Callable, Optional

AVAILABLE = "available memory"
"""The source of a limit that is only the machine's free memory (nothing tighter binds)."""
CONFIGURED = "memory.host_memory_gib"
RESOURCE_LIMITS = ("RLIMIT_DATA", "RLIMIT_AS")
UNLIMITED_CGROUP_BYTES = 2**62
"""A cgroup v1 ``memory.limit_in_bytes`` at or above this means no limit (the kernel writes
``PAGE_COUNTER_MAX`` pages, 9223372036854771712 bytes on 4 KiB pages)."""


@dataclass(frozen=True)
class HostLimit:
    """Host memory the ranks of one machine may use together, and what sets it.

    Attributes:
        bytes: host bytes the ``ranks`` processes may hold together, what they hold now included.
        source: what sets it: ``available memory``, ``memory.host_memory_gib``, ``RLIMIT_DATA``,
            ``RLIMIT_AS`` or ``cgroup v1|v2 … of PATH``.
        ranks: processes of the run on this machine sharing it.
    """

    bytes: int
    source: str
    ranks: int = 1

    @property
    def fails_allocations(self) -> bool:
        """Whether an allocation past the limit fails in the process (a resource limit: torch's
        CPU allocator raises, and the run recovers as from any out-of-memory error), rather than
        the kernel ending the process (a cgroup, the machine's memory) or nothing happening
        (``memory.host_memory_gib``, a planning figure)."""
        return self.source in RESOURCE_LIMITS

    @property
    def hard(self) -> bool:
        """Whether a limit other than the machine's available memory binds (a resource limit or a
        cgroup, past which an allocation fails or the kernel ends the process; or
        ``memory.host_memory_gib``, the user's own bound): a byte the process keeps beyond the
        plan counts against it."""
        return self.source != AVAILABLE

    @property
    def share_bytes(self) -> int:
        """One rank's part of :attr:`bytes`."""
        return self.bytes // max(1, self.ranks)

    def describe(self) -> str:
        """E.g. ``1.40 GiB host memory a rank (RLIMIT_DATA)``."""
        return f"{self.share_bytes / 2**30:.2f} GiB host memory a rank ({self.source})"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _stat_value(text: Optional[str], key: str) -> int:
    match = re.search(rf"^{key} (\d+)$", text or "", re.MULTILINE)
    return int(match.group(1)) if match else 0


def _cgroup_dirs(proc_cgroup: str, root: str) -> list[tuple[str, str]]:
    """``(version, folder)`` of every memory cgroup folder that holds this process, the innermost
    first: its own and each parent up to the mount (a limit anywhere above binds too). A container
    that mounts its own cgroup at ``root`` while ``proc_cgroup`` names the host's path is covered
    by the mount's folder itself."""
    found: list[tuple[str, str]] = []
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and os.path.exists(os.path.join(root, "cgroup.controllers")):
            version, mount = "v2", root
        elif "memory" in controllers.split(","):
            version, mount = "v1", os.path.join(root, "memory")
        else:
            continue
        folder = os.path.normpath(os.path.join(mount, path.lstrip("/")))
        while True:
            found.append((version, folder))
            if os.path.normpath(folder) == os.path.normpath(mount) or len(folder) <= len(mount):
                break
            folder = os.path.dirname(folder)
        if (version, os.path.normpath(mount)) not in found:
            found.append((version, os.path.normpath(mount)))
    return found


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
                 ) -> Optional[tuple[int, int, str]]:
    """The memory cgroup limit that leaves this process the least room, or None (none is set).

    Args:
        proc_cgroup: the process's cgroup membership (``/proc/self/cgroup``).
        root: where the cgroup file systems are mounted (v2 unified at ``root``, v1's memory
            controller at ``root/memory``).

    Returns:
        ``(limit, used, source)``: the limit in bytes, what the cgroup holds now less its
        reclaimable page cache (bytes), and e.g. ``cgroup v2 memory.max of /sys/fs/cgroup/x``.
    """
    best: Optional[tuple[int, int, str]] = None
    for version, folder in _cgroup_dirs(proc_cgroup, root):
        if version == "v2":
            raw, usage, inactive = (_read(os.path.join(folder, "memory.max")), _read(os.path.join(folder, "memory.current")),
                                    _stat_value(_read(os.path.join(folder, "memory.stat")), "inactive_file"))
            name = "memory.max"
        else:
            raw, usage, inactive = (_read(os.path.join(folder, "memory.limit_in_bytes")),
                                    _read(os.path.join(folder, "memory.usage_in_bytes")),
                                    _stat_value(_read(os.path.join(folder, "memory.stat")), "total_inactive_file"))
            name = "memory.limit_in_bytes"
        if raw is None or not raw.isdigit() or int(raw) >= UNLIMITED_CGROUP_BYTES:
            continue  # "max", unreadable, or v1's "no limit"
        limit = int(raw)
        used = max(0, int(usage) - inactive) if usage and usage.isdigit() else 0
        if best is None or limit - used < best[0] - best[1]:
            best = (limit, used, f"cgroup {version} {name} of {folder}")
    return best


def _status_bytes(status: str, key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def process_limits(status_path: str = "/proc/self/status",
                   getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit) -> list[tuple[int, str]]:
    """This process's resource limits on memory and the room each leaves it, bytes.

    Returns:
        ``[(room, name)]`` for ``RLIMIT_DATA`` (its soft limit less ``VmData``, the private
        writable mappings the kernel counts against it) and ``RLIMIT_AS`` (less ``VmSize``), those
        that are set. ``RLIMIT_RSS`` is not enforced by Linux and is not read.
    """
    status = _read(status_path) or ""
    out = []
    for limit_id, name, counted in ((resource.RLIMIT_DATA, "RLIMIT_DATA", "VmData"),
                                    (resource.RLIMIT_AS, "RLIMIT_AS", "VmSize")):
        soft, _ = getrlimit(limit_id)
        if soft != resource.RLIM_INFINITY and soft >= 0:
            out.append((max(0, soft - _status_bytes(status, counted)), name))
    return out


def host_limit(host_memory_gib: float = 0.0, ranks: int = 1, *, resident_bytes: Optional[int] = None,
               available_bytes: Optional[int] = None, cgroup: Optional[tuple[int, int, str]] = None,
               rlimits: Optional[list[tuple[int, str]]] = None) -> HostLimit:
    """The host memory ``ranks`` processes of a run on this machine may hold together: the smallest
    of the machine's available memory, the cgroup limit (:func:`cgroup_limit`), each process's
    resource limits (:func:`process_limits`) and ``host_memory_gib`` (0 = not set), each with what
    the ranks hold now (each taken to hold what this process does: read once every rank is up).

    Args:
        host_memory_gib: ``memory.host_memory_gib``, GiB for the ranks together; 0 = none.
        ranks: the run's processes on this machine (``LOCAL_WORLD_SIZE``).
        resident_bytes, available_bytes, cgroup, rlimits: the readings (None: read here; for tests).

    Returns:
        The :class:`HostLimit` of the smallest; at equal bytes a named limit over the available memory.
    """
    import psutil

    rss = psutil.Process().memory_info().rss if resident_bytes is None else resident_bytes
    held = ranks * rss
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    options = [(available + held, AVAILABLE)]
    limit = cgroup_limit() if cgroup is None else cgroup
    if limit:  # () = no cgroup limit (tests)
        options.append((limit[0] - limit[1] + held, limit[2]))
    for room, name in (process_limits() if rlimits is None else rlimits):
        options.append((ranks * (rss + room), name))
    if host_memory_gib > 0:
        options.append((int(host_memory_gib * 2**30), CONFIGURED))
    smallest = min(b for b, _ in options)
    source = next(s for b, s in reversed(options) if b == smallest)
    return HostLimit(max(0, smallest), source, ranks)


def local_ranks(default: int = 1) -> int:
    """The run's processes on this machine (``LOCAL_WORLD_SIZE``, set by torchrun, Accelerate and
    DeepSpeed's launchers), else ``default``."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))
