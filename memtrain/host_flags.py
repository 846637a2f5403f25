"""OOM agreement flags through the host's shared memory, for ranks that share one machine.

An agreement point (:class:`memtrain.oom.OOMSync`) is a barrier that also tells every rank which
ranks ran out of memory. Through gloo it is one all-reduce: a round trip through the loopback
network and the gloo worker threads, 0.4 ms median and several ms at the 90th percentile on a
2-core machine, paid before every block of a sharded engine (FSDP2, ZeRO-3). When all ranks run
on one host, the same barrier is a few words of shared memory that every rank writes and reads:
0.02–0.04 ms median on the same machine (both measured with 2 ranks, 300 calls between small
matrix products).

Layout (int64): for each rank two *point words*, its process id, and for each point parity a
payload (float64 values, e.g. the step's loss sum) and a check word. At its k-th agreement point
(k = 1, 2, …) a rank writes its payload and the check word, then ``4k + 2·stop + oom`` into word
``k mod 2``, and waits until every rank's word ``k mod 2`` is at least ``4k``. Two of each per
rank are enough: no rank can pass point k+1 before every rank reached it, so while a rank reads
point k no other rank has overwritten its point-k words with point k+2. Each word is one aligned
8-byte store, so a reader sees the old or the new value, never a mix, on x86-64 and AArch64
alike. The order in which another core's stores become visible is not relied on: a payload is
read until its check word (a hash of the point word and the payload) matches.

A peer that died is noticed (its process id no longer exists) and a peer that never arrives
times out (``timeout_s``, the engine's collective timeout); both raise ``RuntimeError`` instead
of hanging, as a gloo collective would.
"""

from __future__ import annotations

import os
import socket
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import numpy as np
import torch


class HostFlags:
    """One rank's view of the shared agreement words (see the module docstring).

    Args:
        name: the shared memory segment's name; ``create`` = make it (one rank only).
        world_size: number of ranks; rank: this rank.
        timeout_s: seconds to wait at a point for the slowest rank before raising.
        payload_slots: float64 values a point may sum over ranks (:meth:`exchange`).

    Raises:
        RuntimeError: from :meth:`exchange`, when a peer process died or did not arrive in time.
    """

    YIELDS = 2000
    """Polls that yield the core (``sched_yield``, a few microseconds each: a waiting rank hands
    its core to any runnable thread, the rank it waits for included) before polls sleep 50 µs."""

    def __init__(self, name: Optional[str], world_size: int, rank: int, timeout_s: float = 600.0,
                 create: bool = False, payload_slots: int = 4):
        # per rank: two point words, the process id, and for each point parity the payload and its check word
        self.payload_slots = payload_slots
        width = 3 + 2 * (payload_slots + 1)
        self._segment = shared_memory.SharedMemory(name=name, create=create, size=8 * width * world_size if create else 0)
        if not create:  # the creator unlinks it; stop this process's tracker from unlinking again
            resource_tracker.unregister(self._segment._name, "shared_memory")
        self.words = np.ndarray((world_size, width), dtype=np.int64, buffer=self._segment.buf)
        if create:
            self.words[:] = 0
        self.words[rank, 2] = os.getpid()
        self.world_size, self.rank, self.timeout_s = world_size, rank, timeout_s
        self.points = 0  # agreement points passed by this rank

    @property
    def name(self) -> str:
        """The segment's name (for the other ranks to attach)."""
        return self._segment.name

    def unlink(self) -> None:
        """Remove the segment's name once every rank attached (attached ranks keep their mapping),
        so nothing is left behind in ``/dev/shm`` however the run ends."""
        self._segment.unlink()

    def exchange(self, oom: bool, stop: bool = False, payload: Optional[np.ndarray] = None
                 ) -> tuple[list[int], bool, Optional[np.ndarray]]:
        """One agreement point: publish this rank's flags (and payload), wait for every rank.

        Args:
            payload: up to ``payload_slots`` float64 values to sum over ranks (None = none).

        Returns:
            (the ranks that ran out of memory, whether any rank's ``stop`` flag was set, the
            payload summed over ranks in rank order — [payload_slots] float64, the same bits on
            every rank — or None when no payload was given).

        Raises:
            RuntimeError: a peer process died, or did not reach the point within ``timeout_s``.
        """
        self.points += 1
        base, slot = 4 * self.points, self.points % 2
        value = base + 2 * int(stop) + int(oom)
        first = 3 + slot * (self.payload_slots + 1)
        bits = np.zeros(self.payload_slots, dtype=np.float64)
        if payload is not None:
            bits[:len(payload)] = payload
        row = self.words[self.rank]
        row[first:first + self.payload_slots] = bits.view(np.int64)
        row[first + self.payload_slots] = _check(value, row[first:first + self.payload_slots])
        row[slot] = value  # published last: a reader that sees it verifies the payload by its check
        self._wait(self.words[:, slot], base)
        values = [int(v) - base for v in self.words[:, slot]]
        summed = self._sum(value_slot=slot, first=first) if payload is not None else None
        return [r for r, v in enumerate(values) if v & 1], any(v & 2 for v in values), summed

    def _wait(self, column: np.ndarray, base: int) -> None:
        spins, deadline, next_check = 0, None, 0.0
        while int(column.min()) < base:
            spins += 1
            if spins < self.YIELDS:
                os.sched_yield()
                continue
            time.sleep(5e-5)
            now = time.monotonic()
            if deadline is None:
                deadline, next_check = now + self.timeout_s, now + 1.0
            elif now >= next_check:
                self._check_peers(column, base, now >= deadline)
                next_check = now + 1.0

    def _sum(self, value_slot: int, first: int) -> np.ndarray:
        """Every rank's payload of this point, summed in rank order. A payload is read until its
        check word matches (the stores of another core may become visible in any order)."""
        summed = np.zeros(self.payload_slots, dtype=np.float64)
        for peer in range(self.world_size):
            while True:
                value = int(self.words[peer, value_slot])
                bits = self.words[peer, first:first + self.payload_slots].copy()
                if int(self.words[peer, first + self.payload_slots]) == _check(value, bits):
                    break
                os.sched_yield()
            summed += bits.view(np.float64)
        return summed

    def _check_peers(self, column: np.ndarray, base: int, timed_out: bool) -> None:
        for peer in range(self.world_size):
            if int(column[peer]) >= base:
                continue
            pid = int(self.words[peer, 2])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise RuntimeError(f"rank {peer} (pid {pid}) exited while rank {self.rank} waited for it at "
                                   f"OOM agreement point {self.points}") from None
            except PermissionError:
                pass
            if timed_out:
                raise RuntimeError(f"rank {peer} did not reach OOM agreement point {self.points} within "
                                   f"{self.timeout_s:.0f} s (backend.timeout_s)")

    def close(self) -> None:
        """Unmap the segment (the words array is dropped first)."""
        self.words = None
        self._segment.close()


def _check(value: int, bits: np.ndarray) -> int:
    """A check word of a point's value and payload bits (FNV-1a over 64-bit words), as int64."""
    h = (0xCBF29CE484222325 ^ (value & _MASK)) * 0x100000001B3 & _MASK
    for b in bits.tolist():
        h = (h ^ (b & _MASK)) * 0x100000001B3 & _MASK
    return h - (1 << 64) if h >= 1 << 63 else h


_MASK = (1 << 64) - 1


def host_flags(world_size: int, rank: int, timeout_s: float, group=None, payload_slots: int = 4
               ) -> Optional[HostFlags]:
    """Shared agreement words for the ranks of ``group`` (the default group: all), when they all
    run on this host (same host name, boot, process-id and IPC namespaces) and could attach the
    segment; None otherwise (or when torch.distributed is not initialised), and the agreements
    stay all-reduces. Collective: every rank must call it.
    """
    if world_size < 2 or not torch.distributed.is_initialized():
        return None
    hosts: list = [None] * world_size
    torch.distributed.all_gather_object(hosts, _host_identity(), group=group)
    if len(set(hosts)) != 1:
        return None
    # rank 0 creates the segment, the others attach to it by name; a rank that cannot (no usable
    # /dev/shm) makes every rank keep the all-reduces
    flags = _open(None, world_size, rank, timeout_s, payload_slots) if rank == 0 else None
    name = [flags.name if flags is not None else None]
    torch.distributed.broadcast_object_list(name, src=0, group=group)
    if rank != 0 and name[0] is not None:
        flags = _open(name[0], world_size, rank, timeout_s, payload_slots)
    attached: list = [None] * world_size
    torch.distributed.all_gather_object(attached, flags is not None, group=group)  # every rank attached
    if rank == 0 and flags is not None:
        flags.unlink()
    if all(attached):
        return flags
    if flags is not None:
        flags.close()
    return None


def _open(name: Optional[str], world_size: int, rank: int, timeout_s: float, payload_slots: int
          ) -> Optional[HostFlags]:
    """Create (``name`` None) or attach the segment; None when the host does not allow it."""
    try:
        return HostFlags(name, world_size, rank, timeout_s, create=name is None, payload_slots=payload_slots)
    except OSError:
        return None


def _host_identity() -> tuple:
    """Host name, boot id and this process's PID and IPC namespaces: ranks with the same identity
    share ``/dev/shm`` and see each other's process ids."""
    found = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid", "/proc/self/ns/ipc"):
        try:
            if "/ns/" in path:
                found.append(os.readlink(path))
            else:
                with open(path) as fh:
                    found.append(fh.read().strip())
        except OSError:
            found.append("")
    return tuple(found)
