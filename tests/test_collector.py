"""The garbage collector at step boundaries (training.gc_every_steps): no automatic collection
inside a step, a young-generation collection every N steps on every rank, Python's state back
after the run."""

import gc

import pytest

from conftest import tiny_args
from memtrain.collector import StepCollector


@pytest.fixture
def generations():
    """The generations of the collections Python runs while the test runs."""
    seen: list[int] = []

    def callback(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(callback)
    yield seen
    gc.callbacks.remove(callback)


def test_collects_young_generations_every_n_steps_and_restores_the_collector(generations):
    assert gc.isenabled()
    with StepCollector(3) as collector:
        assert not gc.isenabled()
        for step in range(1, 8):
            garbage = [[]]
            garbage[0].append(garbage)  # a reference cycle only a collection frees
            del garbage
            collector.after_step(step)
    assert gc.isenabled()
    assert collector.collections == 3  # on entry, after steps 3 and 6
    assert generations == [1, 1, 1]  # never the full (generation 2) pass


def test_zero_leaves_python_s_collector_alone(generations):
    with StepCollector(0) as collector:
        assert gc.isenabled()
        for step in range(1, 5):
            collector.after_step(step)
    assert collector.collections == 0 and generations == []
    with pytest.raises(ValueError, match="every_steps"):
        StepCollector(-1)


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    try:
        with StepCollector(2):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_loop_runs_steps_without_automatic_collection(tmp_path, cache_dir, monkeypatch, generations):
    import memtrain.loop
    from memtrain.train import main

    enabled_in_steps = []
    step = memtrain.loop.step_with_recovery

    def recording(*args, **kwargs):
        enabled_in_steps.append(gc.isenabled())
        return step(*args, **kwargs)

    monkeypatch.setattr(memtrain.loop, "step_with_recovery", recording)
    main(tiny_args(tmp_path, cache_dir, "--training.max_steps", "4", "--training.gc_every_steps", "2"))
    assert enabled_in_steps == [False] * 4
    assert gc.isenabled()
    assert generations.count(1) >= 3  # at the start, after steps 2 and 4
