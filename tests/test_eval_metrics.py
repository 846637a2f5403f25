"""A Python caller's evaluation metrics (``Trainer(compute_metrics=fn)``, memtrain/eval_metrics.py):
computed from the model's own forward outputs, reduced over the evaluation set, recorded as
``val_<name>``, given to the callbacks; bad returns refused by name."""

import pytest
import torch

import memtrain
from memtrain.errors import ConfigError

EXAMPLES = [{"x": torch.full((2,), float(i % 7)), "labels": torch.tensor(float(i % 3))} for i in range(64)]
VALIDATION = EXAMPLES[:12]


def trainer(out, compute_metrics, callbacks=()):
    settings = {"output_dir": str(out), "training": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 4,
                                                     "eval_every": 2, "eval_samples": 12},
                "checkpoint": {"every_steps": 0}}
    return memtrain.Trainer(settings, model=lambda: torch.nn.Linear(2, 1), train_dataset=EXAMPLES,
                            eval_dataset=VALIDATION, objective=lambda m, mb: m(mb["x"]).pow(2).sum(),
                            compute_metrics=compute_metrics, callbacks=list(callbacks))


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
