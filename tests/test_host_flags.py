"""The shared-memory agreement barrier (memtrain.host_flags), in one process: each rank is a
thread with its own view of the same segment."""

import subprocess
import threading

import pytest

from memtrain.host_flags import HostFlags

pytestmark = pytest.mark.timeout(60)


def _views(world: int, timeout_s: float = 30.0) -> list[HostFlags]:
    first = HostFlags(None, world, 0, timeout_s, create=True)
    views = [first] + [HostFlags(first.name, world, r, timeout_s) for r in range(1, world)]
    first.unlink()
    return views


def _run(views, plan):
    """Every view runs ``plan(rank, view)`` in its own thread; returns their results by rank."""
    results, errors = [None] * len(views), []

    def body(rank):
        try:
            results[rank] = plan(rank, views[rank])
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(views))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, errors


def test_every_rank_sees_the_same_flags_at_every_point():
    """300 points, one rank racing ahead where it can: an OOM flag raised by rank 2 at point 7 and
    a stop flag by rank 0 at point 11 are seen by every rank at exactly that point, and nowhere
    else (the two words per rank keep a point's value until every rank has read it)."""
    views = _views(3)

    def plan(rank, view):
        seen = []
        for point in range(1, 301):
            seen.append(view.exchange(oom=rank == 2 and point == 7, stop=rank == 0 and point == 11))
        return seen

    results, errors = _run(views, plan)
    assert not errors
    for seen in results:
        assert seen[6] == ([2], False) and seen[10] == ([], True)
        assert all(s == ([], False) for i, s in enumerate(seen) if i not in (6, 10))


def test_a_dead_peer_is_an_error_not_a_hang():
    views = _views(2)
    gone = subprocess.Popen(["true"])
    gone.wait()
    views[1].words[1, 2] = gone.pid  # rank 1's process no longer exists and never arrives
    with pytest.raises(RuntimeError, match="rank 1 .* exited"):
        views[0].exchange(oom=False)


def test_a_peer_that_never_arrives_times_out():
    views = _views(2, timeout_s=1.5)
    with pytest.raises(RuntimeError, match="did not reach OOM agreement point 1 within 2 s"):
        views[0].exchange(oom=False)
