"""Bad input stops before any work, with an error naming the field; nothing is written."""

import os
import subprocess
import sys

import pytest

from conftest import REPO, TRAIN, TINY_ARGS
from memtrain.config import ConfigError, parse_args

BAD = [
    # (extra args, env world size, field named in the error, a phrase of the allowed values)
    (["--training.foo", "1"], 1, "training.foo", "unknown key"),
    (["--training.max_steps", "abc"], 1, "training.max_steps", "int"),
    (["--precision", "fp8"], 1, "precision", "bf16"),
    (["--backend.name", "horovod"], 1, "backend.name", "ddp"),
    (["--training.global_batch_size", "10", "--training.micro_batch_size", "4"], 1,
     "training.global_batch_size", "multiple of 4"),
    (["--training.global_batch_size", "8", "--training.micro_batch_size", "4"], 4,
     "training.global_batch_size", "multiple of 16"),
    (["--data.files", "[/nonexistent/corpus/*.txt]"], 1, "data.files", "matches no file"),
    (["--data.seq_len", "64"], 1, "data.seq_len", "32 positions"),
    (["--training.micro_batch_size", "0"], 1, "training.micro_batch_size", "positive"),
]


@pytest.mark.parametrize("extra,world_size,field,allowed", BAD, ids=[b[2] + "-" + b[3] for b in BAD])
def test_bad_config_names_field_and_writes_nothing(tmp_path, extra, world_size, field, allowed):
    out = tmp_path / "out"
    env = {**os.environ, "WORLD_SIZE": str(world_size)}
    proc = subprocess.run([sys.executable, TRAIN, *TINY_ARGS, "--output_dir", str(out), *extra],
                          capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert f"'{field}'" in proc.stderr and allowed in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_unknown_key_in_yaml_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("training:\n  max_step: 3\n")
    with pytest.raises(ConfigError, match="max_step"):
        parse_args(["--config", str(recipe)])


def test_overrides_reach_every_section():
    cfg = parse_args(TINY_ARGS + ["--training.max_steps", "7", "--model.config.n_layer", "3", "--local_rank=1"])
    assert cfg.training.max_steps == 7 and cfg.model.config["n_layer"] == 3
    assert cfg.model.config["model_type"] == "gpt2"  # from the recipe, kept beside the override
    assert cfg.precision == "fp32" and cfg.training.micro_batch_size == 2


def test_deprecated_keys_still_work_under_their_new_names(caplog):
    """Renamed keys (activation checkpointing's block stride, the speech cap in audio samples)
    keep working with a warning; given together with a different new value they are refused."""
    cfg = parse_args(TINY_ARGS + ["--memory.checkpoint_every", "2",
                                  "--data.speech.max_frames_per_micro_batch", "16000"])
    assert cfg.memory.activation_checkpointing_every_n_blocks == 2 and cfg.memory.checkpoint_every is None
    assert cfg.data.speech.max_audio_samples_per_micro_batch == 16000
    assert "memory.checkpoint_every is deprecated; use memory.activation_checkpointing_every_n_blocks" in caplog.text
    with pytest.raises(ConfigError, match="memory.activation_checkpointing_every_n_blocks"):
        parse_args(TINY_ARGS + ["--memory.checkpoint_every", "2",
                                "--memory.activation_checkpointing_every_n_blocks", "3"])
