"""A Python caller's evaluation metrics (``Trainer(compute_metrics=fn)``, memtrain/eval_metrics.py):
computed from the model's own forward outputs, reduced over the evaluation set, recorded as
``val_<name>``, given to the callbacks; bad returns refused by name; ``Trainer.evaluate()`` of a
run's last checkpoint."""

import json

import pytest
import torch

import memtrain
from memtrain.errors import ConfigError

EXAMPLES = [{"x": torch.full((2,), float(i % 7)), "labels": torch.tensor(float(i % 3))} for i in range(64)]
VALIDATION = EXAMPLES[:12]


def trainer(out, compute_metrics, callbacks=(), every_steps=0, args=()):
    settings = {"output_dir": str(out), "training": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 4,
                                                     "eval_every": 2, "eval_samples": 12},
                "checkpoint": {"every_steps": every_steps}}
    return memtrain.Trainer(settings, model=lambda: torch.nn.Linear(2, 1), train_dataset=EXAMPLES,
                            eval_dataset=VALIDATION, objective=lambda m, mb: m(mb["x"]).pow(2).sum(),
                            compute_metrics=compute_metrics, callbacks=list(callbacks), args=list(args))


def metrics(outputs, labels):
    """A mean per example (a float) and an exact ratio over the whole set (a sum and a count)."""
    err = (outputs.squeeze(-1) - labels).abs()
    return {"mae": float(err.mean()), "within_1": (float((err < 1).sum()), float(err.numel()))}


def test_metrics_are_the_models_outputs_reduced_over_the_evaluation_set(tmp_path):
    seen = []

    class Watch(memtrain.TrainerCallback):
        def on_evaluate(self, state, values):
            seen.append((state.step, dict(values)))

    result = trainer(tmp_path / "run", metrics, [Watch()]).fit()
    evaluated = [r for r in result.records if "val_mae" in r]
    assert [r["step"] for r in evaluated] == [2, 4] and [s for s, _ in seen] == [2, 4]
    with torch.no_grad():  # the trained model on the validation examples, computed here
        x = torch.stack([e["x"] for e in VALIDATION])
        y = torch.stack([e["labels"] for e in VALIDATION])
        err = (result.model(x).squeeze(-1) - y).abs()
    assert evaluated[-1]["val_mae"] == pytest.approx(float(err.mean()), rel=1e-6)
    assert evaluated[-1]["val_within_1"] == pytest.approx(float((err < 1).float().mean()), rel=1e-6)
    assert seen[-1][1]["val_mae"] == evaluated[-1]["val_mae"]
    assert evaluated[0]["val_mae"] != evaluated[-1]["val_mae"]  # each evaluation's own model


@pytest.mark.parametrize("bad, words", [
    (lambda outputs, labels: 0.5, "must return a dict"),
    (lambda outputs, labels: {"loss": 1.0}, "the objective's"),
    (lambda outputs, labels: {"mae": (1.0, 2.0, 3.0)}, "(sum, count)"),
])
def test_a_bad_return_is_refused_naming_compute_metrics(tmp_path, bad, words):
    with pytest.raises(ConfigError) as refused:
        trainer(tmp_path / "bad", bad).fit()
    assert refused.value.field == "compute_metrics" and words in str(refused.value)


def test_evaluate_reads_the_last_checkpoint_and_writes_nothing(tmp_path):
    """After fit, ``evaluate()`` loads the run's last checkpoint (step 4) and evaluates it as the
    run did at step 4: the same val_loss and metrics, bitwise; no file in the run's folder changes.
    Without a checkpoint, or with ``resume never`` (which would move the run aside), it is refused."""
    out = tmp_path / "run"
    records = trainer(out, metrics, every_steps=2).fit().records
    def files():  # every output, not the run lock (taken and released by any process using the folder)
        return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".memtrain.lock"}

    before = files()
    evaluated = trainer(out, metrics, every_steps=2).evaluate()
    last = records[-1]
    assert evaluated == {"step": 4, "val_loss": last["val_loss"], "val_mae": last["val_mae"],
                         "val_within_1": last["val_within_1"]}
    assert files() == before
    with pytest.raises(ConfigError) as refused:
        trainer(tmp_path / "none", metrics).evaluate()
    assert refused.value.field == "output_dir" and "no checkpoint" in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        trainer(out, metrics, args=["--resume", "never"]).evaluate()
    assert refused.value.field == "resume"


def test_keep_best_never_deletes_the_checkpoint_of_the_best_metric(tmp_path):
    """``checkpoint.keep_best val_score`` with ``keep_last 1``: the checkpoint of the lowest
    val_score (step 2 here, whatever the later ones) stays beside the newest; each manifest
    carries its step's metrics; ``max`` keeps the highest instead; a name that is no recorded
    metric, or saves without an evaluation, are refused by name."""
    import json

    scores = [5.0, 3.0, 1.0, 4.0, 6.0]  # the evaluations at steps 0 (the run's start) to 4

    def score(outputs, labels):
        score.calls += 1
        return {"score": scores[(score.calls - 1) // 6]}  # 12 samples in micro-batches of 2: 6 calls an evaluation

    def kept(mode):
        score.calls = 0
        out = tmp_path / mode
        args = ["--training.eval_every", "1", "--checkpoint.every_steps", "1", "--checkpoint.keep_last", "1",
                "--checkpoint.keep_best", "val_score", "--checkpoint.keep_best_mode", mode]
        trainer(out, score, args=args).fit()
        folders = sorted(p for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
        return {int(p.name[5:]): json.loads((p / "manifest.json").read_text())["metrics"]["val_score"] for p in folders}

    assert kept("min") == {2: 1.0, 4: 6.0}
    assert kept("max") == {4: 6.0}
    for bad, words in ((["--checkpoint.keep_best", "score"], "not an evaluation metric"),
                       (["--checkpoint.keep_best", "val_loss", "--checkpoint.every_steps", "3"], "every saved step")):
        with pytest.raises(ConfigError) as refused:
            trainer(tmp_path / "bad", score, args=bad)
        assert refused.value.field == "checkpoint.keep_best" and words in str(refused.value)


def test_several_evaluation_sets_are_recorded_by_name(tmp_path):
    """``eval_dataset={"near": …, "far": …}``: each set evaluated and recorded as
    ``val_<name>_loss`` / ``val_<name>_<metric>``, values computed here from the trained model on
    that set's examples; ``val_loss`` is the first set's. A name that cannot be part of a key is
    refused by name."""
    near, far = VALIDATION, [{"x": e["x"] + 10, "labels": e["labels"]} for e in VALIDATION]
    settings = {"output_dir": str(tmp_path / "run"), "training": {"global_batch_size": 4, "micro_batch_size": 2,
                                                                  "max_steps": 2, "eval_every": 2, "eval_samples": 12}}
    result = memtrain.Trainer(settings, model=lambda: torch.nn.Linear(2, 1), train_dataset=EXAMPLES,
                              eval_dataset={"near": near, "far": far}, objective=lambda m, mb: m(mb["x"]).pow(2).sum(),
                              compute_metrics=metrics).fit()
    last = result.records[-1]
    with torch.no_grad():
        for name, examples in (("near", near), ("far", far)):
            out = result.model(torch.stack([e["x"] for e in examples])).squeeze(-1)
            assert last[f"val_{name}_loss"] == pytest.approx(float(out.pow(2).mean()), rel=1e-5)
            err = (out - torch.stack([e["labels"] for e in examples])).abs()
            assert last[f"val_{name}_mae"] == pytest.approx(float(err.mean()), rel=1e-5)
    assert last["val_loss"] == last["val_near_loss"] != last["val_far_loss"]
    with pytest.raises(ConfigError) as refused:
        memtrain.Trainer({**settings, "output_dir": str(tmp_path / "bad")}, model=lambda: torch.nn.Linear(2, 1),
                         train_dataset=EXAMPLES,
                         eval_dataset={"a b": near}, objective=lambda m, mb: m(mb["x"]).pow(2).sum()).fit()
    assert refused.value.field == "eval_dataset"


def test_predict_gives_the_checkpointed_models_output_for_every_example(tmp_path):
    """``predict(dataset)`` after fit: one row per example in the dataset's order, equal to the
    trained model's output computed here (13 examples at evaluation micro-batch 2: a last short
    micro-batch); files unchanged; an empty dataset and a folder without a checkpoint refused."""
    out = tmp_path / "run"
    result = trainer(out, metrics, every_steps=2).fit()
    examples = EXAMPLES[20:33]
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".memtrain.lock"}
    rows = trainer(out, metrics, every_steps=2).predict(examples)
    with torch.no_grad():
        expected = result.model(torch.stack([e["x"] for e in examples]))
    assert len(rows) == 13 and torch.allclose(torch.stack(rows), expected, rtol=1e-6, atol=1e-6)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".memtrain.lock"} == before
    with pytest.raises(ConfigError) as refused:
        trainer(out, metrics, every_steps=2).predict([])
    assert refused.value.field == "dataset"
    with pytest.raises(ConfigError) as refused:
        trainer(tmp_path / "none", metrics).predict(examples)
    assert refused.value.field == "output_dir"


PREDICT = """
import json, os, sys, torch
import memtrain
examples = [{"x": torch.full((2,), float(i % 7)), "labels": torch.tensor(float(i % 3))} for i in range(64)]
trainer = memtrain.Trainer({"output_dir": sys.argv[1], "precision": "fp32", "training": {"global_batch_size": 4, "micro_batch_size": 2,
                                                                    "max_steps": 2, "eval_every": 0},
                            "checkpoint": {"every_steps": 2}},
                           model=lambda: torch.nn.Linear(2, 1), train_dataset=examples,
                           objective=lambda m, mb: m(mb["x"]).pow(2).sum(), args=sys.argv[2:])
trainer.fit()
rows = trainer.predict(examples[20:33])
with open(f"{sys.argv[1]}.rows_{os.environ['RANK']}.json", "w") as fh:  # a file each: printed lines interleave
    json.dump([r.tolist() for r in rows], fh)
"""


@pytest.mark.slow
def test_predict_on_two_ranks_covers_every_example_once_in_order(tmp_path):
    """ZeRO-3 on 2 ranks, fit then predict in one process (the second process group on store keys
    of its own: on the first's it waited for ever, from time to time; DeepSpeed's cached groups
    released with the first), 13 examples (one rank gets a repeated last example so both run
    as many forwards): both ranks return the same 13 rows, in order, equal to the exported weights
    applied here."""
    from safetensors.torch import load_file

    from conftest import launch

    script = tmp_path / "predict.py"
    script.write_text(PREDICT)
    # fit() and predict() are two runs in one process, each with a process group of its own on
    # the launcher's store (memtrain.distributed: keys of its own)
    launch([str(tmp_path / "run"), "--backend.name", "deepspeed", "--backend.zero_stage", "3"],
           script=str(script), timeout=240)
    rows = {rank: json.loads((tmp_path / f"run.rows_{rank}.json").read_text()) for rank in ("0", "1")}
    assert rows["0"] == rows["1"]
    weights = load_file(str(tmp_path / "run" / "model" / "model.safetensors"))
    x = torch.stack([torch.full((2,), float(i % 7)) for i in range(20, 33)])
    expected = x @ weights["weight"].T + weights["bias"]
    assert torch.allclose(torch.tensor(rows["0"]), expected, rtol=1e-5, atol=1e-5)
