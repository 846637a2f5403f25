"""Precision selection and the non-finite guard."""

import math

import pytest

from conftest import ENGINES, STEPS, child_exit_codes, launch, read_metrics, tiny_args
from memtrain.precision import NonFiniteGuard, NonFiniteStop, resolve_precision

# (device, compute capability) → what precision auto must choose
CAPABILITIES = {
    "V100": ((7, 0), "fp32"),  # no native bf16; fp16 overflows in speech models: never fp16
    "T4": ((7, 5), "fp32"),
    "A100": ((8, 0), "bf16"),
    "A10": ((8, 6), "bf16"),
    "H100": ((9, 0), "bf16"),
}


@pytest.mark.parametrize("gpu", list(CAPABILITIES))
def test_auto_precision_by_cuda_capability(gpu):
    capability, expected = CAPABILITIES[gpu]
    assert resolve_precision("auto", "cuda", cuda_capability=capability) == expected
    assert resolve_precision("fp16", "cuda", cuda_capability=capability) == "fp16"  # only when asked


@pytest.mark.parametrize("has_bf16,expected", [(True, "bf16"), (False, "fp32")])
def test_auto_precision_on_cpu(has_bf16, expected):
    assert resolve_precision("auto", "cpu", cpu_bf16=has_bf16) == expected


def test_unknown_precision_names_field():
    with pytest.raises(ValueError, match="precision.*fp8.*auto, bf16, fp16, fp32"):
        resolve_precision("fp8", "cpu")


def test_fp16_on_cpu_is_refused_not_silently_fp32():
    from memtrain.config import ConfigError

    with pytest.raises(ConfigError, match="precision.*fp16 needs a CUDA GPU"):
        resolve_precision("fp16", "cpu")


def test_guard_counts_consecutive_skips_only():
    guard = NonFiniteGuard(3)
    assert guard.update(1, math.nan, 1.0) and guard.update(2, 1.0, math.inf)
    assert not guard.update(3, 1.0, 1.0) and guard.streak == 0  # a good step resets the count
    guard.update(4, math.nan, math.nan)
    guard.update(5, math.nan, math.nan)
    with pytest.raises(NonFiniteStop, match="3 consecutive steps.*max_nonfinite_steps"):
        guard.update(6, math.nan, math.nan)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "zero2"])
def test_nan_step_is_skipped_on_every_rank(tmp_path, cache_dir, reference, engine):
    base = read_metrics(reference(engine))
    proc = launch(tiny_args(tmp_path / "nan", cache_dir, "--training.max_steps", str(STEPS), "--faults.nan_at_step", "3",
                            *ENGINES[engine]))
    records = read_metrics(tmp_path / "nan")
    assert [r.get("event") for r in records] == [None, None, "nonfinite_skip"] + [None] * (STEPS - 3)
    assert math.isnan(records[2]["loss"])
    assert proc.stderr.count("step 3: non-finite loss nan") == 1  # said once: every rank skips the same step
    # a rank that had stepped on NaN gradients would make every later (all-reduced) loss NaN
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records[3:])
    assert [r["loss"] for r in records[:2]] == [r["loss"] for r in base[:2]]


@pytest.mark.slow
def test_too_many_nan_steps_stop_with_checkpoint_intact(tmp_path, cache_dir):
    from safetensors.torch import load_file

    from memtrain.checkpoint import complete_checkpoints, verify

    proc = launch(tiny_args(tmp_path, cache_dir, "--training.max_steps", "12", "--checkpoint.every_steps", "2",
                            "--faults.nan_at_step", "3", "--faults.nan_steps", "10", "--training.max_nonfinite_steps", "4",
                            "--backend.name", "ddp"), check=False)
    assert proc.returncode != 0 and child_exit_codes(proc) == {5}  # too many non-finite steps in a row
    assert "4 consecutive steps (up to step 6) had a non-finite loss" in proc.stderr
    checkpoints = complete_checkpoints(str(tmp_path / "checkpoints"))
    assert [c[-2:] for c in checkpoints] == ["02", "04"]  # nothing saved at the stopping step
    for path in checkpoints:
        verify(path)
        weights = load_file(f"{path}/model.safetensors")
        assert all(t.isfinite().all() for t in weights.values())
    # the skipped steps left the weights exactly as the last good step made them
    before, after = (load_file(f"{p}/model.safetensors") for p in checkpoints)
    assert all((before[k] == after[k]).all() for k in before)
