"""The user's callbacks (memtrain/callbacks.py): the hooks run at the run's moments with a
read-only state, a stop asked by a callback ends the run with a checkpoint and a rerun resumes
exactly, a callback that raises stops every rank naming it, and EarlyStopping stops when its
metric stops improving."""

import json

import pytest
import torch

from conftest import launch, read_metrics
import memtrain
from memtrain.callbacks import CallbackError, Callbacks, EarlyStopping, TrainerCallback, TrainerState
from memtrain.checkpoint.layout import step_dir_name

EXAMPLES = [{"x": torch.full((2,), float(i % 7))} for i in range(64)]


def trainer(out, callbacks=(), **training):
    settings = {"output_dir": str(out), "training": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 6,
                                                     "eval_every": 2, "eval_samples": 4, **training},
                "checkpoint": {"every_steps": 0}}
    return memtrain.Trainer(settings, model=lambda: torch.nn.Linear(2, 1), train_dataset=EXAMPLES,
                            eval_dataset=EXAMPLES[:8], objective=lambda m, mb: m(mb["x"]).pow(2).sum(),
                            callbacks=list(callbacks))


class Recorder(TrainerCallback):
    def __init__(self, stop_at=None):
        self.calls, self.stop_at = [], stop_at

    def on_train_begin(self, state):
        self.calls.append(("begin", state.step))

    def on_step_end(self, state):
        self.calls.append(("step", state.step, state.record["loss"], dict(state.plan)))
        if state.step == self.stop_at:
            state.should_stop = True

    def on_evaluate(self, state, metrics):
        self.calls.append(("evaluate", state.step, metrics["val_loss"]))

    def on_save(self, state, path):
        self.calls.append(("save", state.step, path))

    def on_train_end(self, state):
        self.calls.append(("end", state.step, dict(state.metrics)))


def test_hooks_run_at_the_runs_moments_with_its_records_and_a_read_only_state(tmp_path):
    """Each hook at its moment, in order, with what ``metrics.jsonl`` holds (the step's loss, the
    evaluation's val_loss, the plan); the state's fields cannot be changed by a hook."""
    rec = Recorder()
    trainer(tmp_path / "run", [rec]).fit()
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert rec.calls[0] == ("begin", 0)
    steps = [c for c in rec.calls if c[0] == "step"]
    assert [(c[1], c[2]) for c in steps] == [(r["step"], r["loss"]) for r in records]
    assert steps[0][3] == {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "levers": steps[0][3]["levers"]}
    evaluated = [(c[1], c[2]) for c in rec.calls if c[0] == "evaluate"]
    assert evaluated == [(r["step"], r["val_loss"]) for r in records if "val_loss" in r] and len(evaluated) == 3
    assert rec.calls[-1] == ("end", 6, {"val_loss": records[-1]["val_loss"]})
    state = TrainerState(3, 0, {"micro_batch_size": 2}, {"loss": 1.0})
    with pytest.raises(AttributeError):
        state.step = 4
    with pytest.raises(TypeError):
        state.record["loss"] = 0.0


def test_a_stop_asked_by_a_callback_saves_the_step_and_a_rerun_resumes_at_the_next(tmp_path):
    """``state.should_stop`` at step 3: the run ends after step 3 with a checkpoint of it (the
    hook told of it) and no export; rerun without the callback, it resumes at step 4 and its
    steps 4-6 are bitwise the uninterrupted run's."""
    straight = trainer(tmp_path / "straight").fit().records
    rec = Recorder(stop_at=3)
    result = trainer(tmp_path / "run", [rec]).fit()
    assert [r["step"] for r in result.records] == [1, 2, 3]
    assert "callback" in result.summary["preempted"]
    saves = [c for c in rec.calls if c[0] == "save"]
    step_3 = tmp_path / "run" / "checkpoints" / step_dir_name(3)
    assert len(saves) == 1 and saves[0][1] == 3 and saves[0][2] == str(step_3) and step_3.is_dir()
    assert not (tmp_path / "run" / "model").exists()
    resumed = trainer(tmp_path / "run").fit().records
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for r, s in zip(resumed, straight[3:]):
        assert (r["loss"], r["batch_fingerprint"]) == (s["loss"], s["batch_fingerprint"])


def test_early_stopping_stops_after_patience_evaluations_without_improvement():
    """The metric's history 3, 2, 2.5, 2.1, 2.05 with patience 2 and min_delta 0.1: the stop comes
    at the fourth evaluation (2.5 and 2.1 are not 0.1 better than 2); mode max mirrors it; bad
    settings and a metric the evaluation lacks are refused by name."""
    def stops(values, **kw):
        es, out = EarlyStopping(**kw), []
        for v in values:
            state = TrainerState(0, 0, {})
            es.on_evaluate(state, {"val_loss": v})
            out.append(state.should_stop)
        return out

    assert stops([3, 2, 2.5, 2.1, 2.05], patience=2, min_delta=0.1) == [False, False, False, True, True]
    assert stops([-3, -2, -2.5, -2.1], patience=2, min_delta=0.1, mode="max") == [False, False, False, True]
    assert stops([3, 2, 1, 0.5], patience=1) == [False] * 4
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(patience=0)
    with pytest.raises(CallbackError, match="EarlyStopping.on_evaluate raised KeyError.*'val_accuracy'"):
        Callbacks([EarlyStopping(metric="val_accuracy")]).call("on_evaluate", TrainerState(0, 0, {}), {"val_loss": 1.0})
    with pytest.raises(memtrain.ConfigError, match="'callbacks'"):
        memtrain.Trainer(model=torch.nn.Linear(2, 1), train_dataset=EXAMPLES, callbacks=[lambda state: None])

    class Misnamed(memtrain.TrainerCallback):  # a typo and Lightning's name: neither would ever run
        def on_step_ends(self, state):
            pass

        def on_validation_end(self, state):
            pass

    with pytest.raises(memtrain.ConfigError) as info:
        memtrain.Trainer(model=torch.nn.Linear(2, 1), train_dataset=EXAMPLES, callbacks=[Misnamed()])
    assert info.value.field == "callbacks" and ("Misnamed defines on_step_ends (memtrain calls on_step_end), "
                                                "on_validation_end (memtrain calls on_evaluate), which memtrain "
                                                "never calls") in str(info.value)
    import transformers

    class Helpers(memtrain.TrainerCallback, transformers.TrainerCallback):  # one callback for two trainers
        @property
        def on_main_rank(self):  # read without being run: it would raise
            raise AssertionError("the check ran a property")

        @staticmethod
        def on_rank_zero(fn):  # a helper, no hook's near-miss
            return fn

    memtrain.Trainer(model=torch.nn.Linear(2, 1), train_dataset=EXAMPLES, callbacks=[Helpers()])


BOOM = """
import os, sys, torch
import memtrain
rank = int(os.environ["RANK"])

class Boom(memtrain.TrainerCallback):
    def on_step_end(self, state):
        if rank == 1 and state.step == 2:
            raise ValueError("no room for samples")

class Stop(memtrain.TrainerCallback):
    def on_step_end(self, state):
        state.should_stop = rank == 1 and state.step == 3

examples = [{"x": torch.full((2,), float(i % 7))} for i in range(64)]
callbacks = [Boom()] if sys.argv[2] == "boom" else [Stop()]
try:
    memtrain.Trainer({"output_dir": sys.argv[1], "training": {"global_batch_size": 4, "micro_batch_size": 2,
                                                              "max_steps": 6, "eval_every": 0}},
                     model=lambda: torch.nn.Linear(2, 1), train_dataset=examples, callbacks=callbacks,
                     objective=lambda m, mb: m(mb["x"]).sum()).fit()
except memtrain.CallbackError as exc:
    print(f"CallbackError on rank {rank}: {exc}", flush=True)
    sys.exit(7)
"""


@pytest.mark.slow
def test_every_rank_agrees_on_a_callbacks_stop_and_on_its_failure(tmp_path):
    """Two ranks: a stop asked on rank 1 alone at step 3 ends both after step 3 with one checkpoint;
    a callback raising on rank 1 alone at step 2 stops both with memtrain.CallbackError naming the
    callback, the hook, the exception and rank 1 (no rank left waiting)."""
    script = tmp_path / "boom.py"
    script.write_text(BOOM)
    launch([str(tmp_path / "stop"), "stop"], script=str(script), timeout=180)
    steps = [r["step"] for r in read_metrics(tmp_path / "stop") if "loss" in r]
    assert steps == [1, 2, 3] and (tmp_path / "stop" / "checkpoints" / step_dir_name(3)).is_dir()
    assert "callback" in json.loads((tmp_path / "stop" / "summary.json").read_text())["preempted"]
    proc = launch([str(tmp_path / "boom"), "boom"], script=str(script), check=False, timeout=180)
    said = sorted(line for line in proc.stdout.splitlines() if line.startswith("CallbackError on rank"))
    assert len(said) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in said:
        assert "callback Boom.on_step_end raised ValueError: no room for samples (rank 1)" in line
