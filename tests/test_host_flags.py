"""The shared-memory agreement barrier (memtrain.host_flags), in one process: each rank is a
thread with its own view of the same segment."""

import subprocess
import threading

import numpy as np
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


def test_every_rank_sees_the_same_flags_and_sums_at_every_point():
    """300 points, one rank racing ahead where it can: an OOM flag raised by rank 2 at point 7 and
    a stop flag by rank 0 at point 11 are seen by every rank at exactly that point, and nowhere
    else (the two words per rank keep a point's value until every rank has read it); every
    point's payload is summed over ranks, the same on every rank."""
    views = _views(3)

    def plan(rank, view):
        seen = []
        for point in range(1, 301):
            ranks, stop, summed = view.exchange(oom=rank == 2 and point == 7, stop=rank == 0 and point == 11,
                                                payload=np.array([rank + 1.0, point, 0.1 * rank]))
            seen.append((ranks, stop, summed.tolist()))
        return seen

    results, errors = _run(views, plan)
    assert not errors
    for seen in results:
        assert [(r, s) for r, s, _ in seen] == [([2] if p == 7 else [], p == 11) for p in range(1, 301)]
        assert [summed for _, _, summed in seen] == [[6.0, 3.0 * p, 0.1 + 0.2, 0.0] for p in range(1, 301)]
    for v in views:
        v.close()


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
