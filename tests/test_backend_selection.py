"""Engine choice from the config and the launcher, and the DeepSpeed JSON reconciliation."""

import json

import pytest

from memtrain.backends import infer_backend_name
from memtrain.backends.deepspeed import build_ds_config
from memtrain.config import ConfigError

PLAN = dict(global_batch_size=16, micro_batch_size=2, gradient_accumulation_steps=4, max_grad_norm=1.0,
            precision="fp32", precision_requested="fp32", zero_stage=None, offload=None)


@pytest.mark.parametrize("env,ds,expected", [
    ({}, None, "ddp"),
    ({"ACCELERATE_USE_FSDP": "true"}, None, "fsdp"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, None, "deepspeed"),
    ({}, "ds_configs/zero2.json", "deepspeed"),
])
def test_auto_follows_the_launcher(monkeypatch, env, ds, expected):
    for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert infer_backend_name("auto", ds) == expected
    assert infer_backend_name("ddp", ds) == "ddp"  # an explicit choice wins


def test_auto_values_are_filled_from_memtrain():
    with open("ds_configs/zero3_offload.json") as fh:
        user = json.load(fh)
    cfg = build_ds_config(user, "zero3_offload.json", **PLAN)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (16, 2, 4)
    assert cfg["gradient_clipping"] == 1.0 and cfg["bf16"]["enabled"] is False and cfg["fp16"]["enabled"] is False
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


@pytest.mark.parametrize("key,value,field", [
    ("train_micro_batch_size_per_gpu", 4, "training.micro_batch_size"),
    ("train_batch_size", 64, "training.global_batch_size"),
    ("gradient_clipping", 0.5, "training.max_grad_norm"),
])
def test_contradicting_value_names_both(key, value, field):
    with pytest.raises(ConfigError) as err:
        build_ds_config({key: value}, "mine.json", **PLAN)
    msg = str(err.value)
    assert f"'{field}'" in msg and f"mine.json sets {key} = {value}" in msg


def test_contradicting_stage_and_precision():
    with pytest.raises(ConfigError, match="backend.zero_stage"):
        build_ds_config({"zero_optimization": {"stage": 3}}, "mine.json", **{**PLAN, "zero_stage": 2})
    with pytest.raises(ConfigError, match="'precision'.*bf16.enabled"):
        build_ds_config({"bf16": {"enabled": True}}, "mine.json", **PLAN)
    # precision auto defers to an explicit choice in the JSON
    cfg = build_ds_config({"bf16": {"enabled": True}}, "mine.json", **{**PLAN, "precision_requested": "auto"})
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False


def test_optimizer_section_is_refused():
    with pytest.raises(ConfigError, match="optimizer"):
        build_ds_config({"optimizer": {"type": "AdamW"}}, "mine.json", **PLAN)
