"""Bad input stops before any work, with an error naming the field; nothing is written."""

import os

import pytest
import torch

from conftest import TINY_ARGS, run_cli
from memtrain.config import ConfigError, parse_args

BAD = [
    # (extra args, env world size, field named in the error, a phrase of the allowed values)
    (["--training.foo", "1"], 1, "training.foo", "unknown key"),
    (["--training.max_steps", "abc"], 1, "training.max_steps", "'abc' is not an integer"),
    (["--precision", "fp8"], 1, "precision", "'fp8' is not one of auto, bf16, fp16, fp32"),
    (["--backend.zero_stage", "4"], 1, "backend.zero_stage", "'4' is not one of 1, 2, 3"),
    (["--backend.name", "ddp", "--backend.reshard_after_forward", "false"], 1, "backend.reshard_after_forward",
     "a setting of backend.name fsdp"),
    (["--backend.name", "deepspeed", "--backend.reshard_after_forward", "false"], 1, "backend.reshard_after_forward",
     "a setting of backend.name fsdp"),
    (["--backend.name", "horovod"], 1, "backend.name", "ddp"),
    (["--training.global_batch_size", "10", "--training.micro_batch_size", "4"], 1,
     "training.global_batch_size", "multiple of 4"),
    (["--training.global_batch_size", "8", "--training.micro_batch_size", "4"], 4,
     "training.global_batch_size", "multiple of 16"),
    (["--data.files", "[/nonexistent/corpus/*.txt]"], 1, "data.files", "matches no file"),
    (["--data.seq_len", "64"], 1, "data.seq_len", "32 positions"),
    (["--training.micro_batch_size", "0"], 1, "training.micro_batch_size", "positive"),
    (["--optimizer.state_dtype", "bf16", "--backend.name", "deepspeed"], 1, "optimizer.state_dtype", "ddp and fsdp"),
]


@pytest.mark.parametrize("extra,world_size,field,allowed", BAD, ids=[b[2] + "-" + b[3] for b in BAD])
def test_bad_config_names_field_and_writes_nothing(tmp_path, extra, world_size, field, allowed):
    out = tmp_path / "out"
    proc = run_cli([*TINY_ARGS, "--output_dir", str(out), *extra], env={"WORLD_SIZE": str(world_size)}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"'{field}'" in proc.stderr and allowed in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_unknown_key_in_yaml_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("training:\n  max_step: 3\n")
    with pytest.raises(ConfigError, match="unknown key 'training.max_step' in the recipe .did you mean "
                                         "'training.max_steps'") as err:
        parse_args(["--config", str(recipe)])
    assert err.value.field == "training.max_step"


@pytest.mark.parametrize("given, field, phrase", [
    ({"training": 5}, "training", "is a section of settings, not a value"),  # was a TypeError from the parser's output
    ({"backend": "fsdp"}, "backend", "in Python {'backend': {'name': ...}}, on the command line --backend.name"),
    ({"data": {"speech": 3}}, "data.speech", "in Python {'data': {'speech': {"),
    ({"preicsion": "fp32"}, "preicsion", "did you mean 'precision'"),
    ({"trainig": {"max_steps": 3}}, "trainig.max_steps", "did you mean 'training.max_steps'"),
])
def test_a_section_given_a_value_or_a_mistyped_section_is_named(given, field, phrase):
    """A Python dict (or recipe) whose section is a value, or whose section or top-level key is
    mistyped: the key is named, with what was meant."""
    import json

    with pytest.raises(ConfigError) as info:
        parse_args(["--config", json.dumps(given)])
    assert info.value.field == field and phrase in str(info.value), str(info.value)
    assert parse_args(["--config", json.dumps({"training": None})]).training.max_steps > 0  # keys all commented out


def test_model_config_keys_transformers_reads_are_taken_and_others_refused():
    """A key the config class derives another setting from (Phi-3's partial_rotary_factor) or the
    modeling code reads (T5's decoder_start_token_id) is taken; one nothing reads is refused."""
    from memtrain.validation import check_config_keys

    check_config_keys("phi3", {"partial_rotary_factor": 0.5})
    check_config_keys("t5", {"decoder_start_token_id": 0})
    check_config_keys("llama", {"rope_theta": 1e4, "head_dim": 8, "attn_implementation": "eager", "num_labels": 3})
    with pytest.raises(ConfigError, match="'model.config.rope_theta': is not a setting of transformers' GPT2Config"):
        check_config_keys("gpt2", {"rope_theta": 1e4})


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


BAD_VALUES = [
    # (extra args, field named in the error, a phrase of the message)
    (["--training.max_step", "2"], "training.max_step", "did you mean 'training.max_steps'"),  # no abbreviations
    (["--training.min_lr", "1e-5"], "training.min_lr", "did you mean 'training.min_lr_ratio'"),
    (["--training.lr", "-3e-3"], "training.lr", "must be > 0"),  # parses as a number, then refused
    (["--training.warmup_steps", "-1"], "training.warmup_steps", "0 = no warmup"),
    (["--training.max_grad_norm", "-1"], "training.max_grad_norm", "0 = no clipping"),
    (["--training.eval_samples", "0"], "training.eval_samples", "must be >= 1"),
    (["--training.gc_every_steps", "-1"], "training.gc_every_steps", "0 = Python's automatic"),
    (["--backend.name", "fsdp", "--backend.zero_stage", "2"], "backend.zero_stage", "DeepSpeed setting"),
    (["--backend.timeout_s", "0"], "backend.timeout_s", "must be > 0"),
    (["--memory.allow_lossy_levers", "true"], "memory.allow_lossy_levers", "set memory.levers auto"),  # nothing chooses
    # torch.compile (torchao's int8 step) refuses MemTracker's dispatch mode: the run would fail at step 1
    (["--optimizer.state_dtype", "int8", "--logging.memory_breakdown_step", "1"], "logging.memory_breakdown_step",
     "torch.compile refuses"),
    (["--backend.offload_optimizer_ratio", "1.5"], "backend.offload_optimizer_ratio", "must be in (0, 1]"),
    (["--backend.offload", "auto", "--backend.offload_optimizer_ratio", "0.5"], "backend.offload_optimizer_ratio",
     "chosen by the planner"),
    # DeepSpeed's refusal of lossy moments comes before the bf16 rules it would not need
    (["--backend.name", "deepspeed", "--optimizer.state_dtype", "bf16", "--training.adam_beta2", "0.999"],
     "optimizer.state_dtype", "is for ddp and fsdp"),
    (["--checkpoint.format", "deepspeed"], "checkpoint.format", "cannot be written by engine ddp: choose auto or dcp"),
]


@pytest.mark.parametrize("extra,field,phrase", BAD_VALUES, ids=[b[0][0] for b in BAD_VALUES])
def test_bad_values_are_refused_by_name(tmp_path, extra, field, phrase):
    from memtrain.validation import validate

    with pytest.raises(ConfigError) as info:
        validate(parse_args(TINY_ARGS + ["--output_dir", str(tmp_path / "out"), *extra]), 1)
    assert info.value.field == field and phrase in str(info.value)
    assert not (tmp_path / "out").exists()


def test_paths_that_cannot_be_what_they_name(tmp_path):
    """A folder as data.files, a file as output_dir, a malformed YAML recipe: named, with the path."""
    from memtrain.validation import validate

    (tmp_path / "corpus").mkdir()
    (tmp_path / "a_file").write_text("x")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("training:\n  lr: [1, 2\n")
    cases = [(["--data.files", f"[{tmp_path / 'corpus'}]"], "data.files", "is a folder"),
             (["--output_dir", str(tmp_path / "a_file")], "output_dir", "is not a folder"),
             (["--config", str(bad_yaml)], "config", f"{bad_yaml} is not valid YAML")]
    for extra, field, phrase in cases:
        with pytest.raises(ConfigError) as info:
            validate(parse_args(TINY_ARGS + ["--output_dir", str(tmp_path / "out"), *extra]), 1)
        assert info.value.field == field and phrase in str(info.value), info.value
    assert parse_args(TINY_ARGS + ["--training.min_lr_ratio", "1e-2", "--training.lr", "3e-3"]).training.lr == 3e-3


def test_bad_data_files_are_named_with_file_and_line(tmp_path):
    """An empty file, a binary file, a malformed JSONL line, a line without the text field, a
    text field that is null or a number (never trained as the text "None" or "42")."""
    from memtrain.data.corpus import iter_documents, select_files

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01binary")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "cut\n')
    (tmp_path / "other.jsonl").write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    (tmp_path / "null.jsonl").write_text('{"text": "ok"}\n{"text": null}\n')
    (tmp_path / "number.jsonl").write_text('{"text": 42}\n')
    for name, field, phrase in [("empty.txt", "data.files", "is empty"), ("blob.txt", "data.files", "looks binary")]:
        with pytest.raises(ConfigError) as info:
            select_files([str(tmp_path / name)])
        assert info.value.field == field and phrase in str(info.value) and name in str(info.value)
    for name, field, phrase in [("bad.jsonl", "data.files", "bad.jsonl:2: not valid JSON"),
                                ("other.jsonl", "data.text_field", "other.jsonl:3: no field 'text'"),
                                ("null.jsonl", "data.text_field", "null.jsonl:2: field 'text' is null, not a string"),
                                ("number.jsonl", "data.text_field", "number.jsonl:1: field 'text' is 42")]:
        with pytest.raises(ConfigError) as info:
            list(iter_documents(select_files([str(tmp_path / name)])))
        assert info.value.field == field and phrase in str(info.value)


def test_the_validation_split_holds_whole_files_within_the_fraction_of_bytes(tmp_path, caplog):
    """An 8 MB and a 20 KB file at 0.05: the 20 KB file is held out, whatever the names hash to;
    80 files of mixed sizes: the held-out bytes stay within the fraction, the same split twice.
    Two files of one size: one is held out (never most of the data), with a warning."""
    from memtrain.data.corpus import SourceFile, split_files

    for big, small in [("a.txt", "b.txt"), ("b.txt", "a.txt"), ("corpus/main.txt", "corpus/x.txt")]:
        train, val = split_files([SourceFile(big, big, 8_000_000), SourceFile(small, small, 20_000)], 0.05)
        assert [f.name for f in val] == [small] and [f.name for f in train] == [big]
    files = [SourceFile(f"f{i}.py", f"f{i}.py", 1000 + 997 * i % 50_000) for i in range(80)]
    total = sum(f.size for f in files)
    train, val = split_files(files, 0.05)
    held = sum(f.size for f in val)
    assert 0 < held <= 0.05 * total and len(train) + len(val) == 80
    assert split_files(list(reversed(files)), 0.05) == (train, val)
    train, val = split_files([SourceFile("a", "a", 5000), SourceFile("b", "b", 5000)], 0.05)
    assert len(train) == len(val) == 1 and "is 50.0% of the 2 files' bytes" in caplog.text


def test_a_full_cache_disk_is_a_config_error_naming_the_folder(tmp_path, monkeypatch):
    """The data cache's disk fills while it is built: exit 2's error naming the cache setting, the
    folder and its free bytes; nothing half-built is left."""
    import errno

    import memtrain.data.tokens as tokens
    from memtrain.data import build_corpus

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("def add(a, b):\n    return a + b\n" * 40)

    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tokens.np, "save", no_room)
    cfg = parse_args(TINY_ARGS + ["--data.files", f"['{tmp_path}/*.txt']", "--data.cache_dir", str(tmp_path / "cache"),
                                  "--data.max_bytes", "0"])
    with pytest.raises(ConfigError) as info:
        build_corpus(cfg.data)
    assert info.value.field == "data.cache_dir" and "the disk is full" in str(info.value)
    assert str(tmp_path / "cache") in str(info.value) and "bytes free" in str(info.value)
    assert os.listdir(tmp_path / "cache") == []


def test_a_model_output_without_logits_is_named():
    """A forward that returns None (or a tuple): a ConfigError naming the model, not an AttributeError."""
    from memtrain.models import logits_of

    for output in (None, (torch.zeros(1),)):
        with pytest.raises(ConfigError) as info:
            logits_of(output)
        assert info.value.field == "model" and "its forward returned" in str(info.value)


def test_a_vocab_size_the_tokenizer_cannot_reach_is_said(tmp_path, caplog):
    """data.vocab_size below the byte alphabet: the model gets the tokenizer's real size, with a
    warning; building the cache says so first, reading it says nothing."""
    from memtrain.data import build_corpus

    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("def add(a, b):\n    return a + b\n" * 40)
    cfg = parse_args(TINY_ARGS + ["--data.files", f"['{tmp_path}/*.txt']", "--data.vocab_size", "100",
                                  "--data.cache_dir", str(tmp_path / "cache"), "--data.max_bytes", "0"])
    corpus = build_corpus(cfg.data)
    assert corpus.vocab_size > 256
    assert f"data.vocab_size 100: the tokenizer has {corpus.vocab_size} tokens (the byte-level alphabet" in caplog.text
    # the cold cache's minute is not a silent one; a warm one is not announced
    assert caplog.text.count("building the data cache: training a 100-token BPE tokenizer") == 1
    build_corpus(cfg.data)
    assert caplog.text.count("building the data cache") == 1


def test_the_config_is_read_only_after_validation(tmp_path):
    """What the launcher's JSON or the placement planner decide goes into the engine spec, never
    back into the user's config: a write after validation fails, in any section."""
    from memtrain.backends.spec import resolve_engine
    from memtrain.config import FrozenConfigError
    from memtrain.validation import validate

    cfg = parse_args(TINY_ARGS + ["--output_dir", str(tmp_path / "out"), "--backend.name", "auto"])
    cfg.training.lr = 2e-3  # before validation: still the parser's to finish
    validate(cfg, 1)
    for section, name, value in ((cfg.backend, "offload", "optimizer"), (cfg.training, "lr", 1.0), (cfg, "resume", "never")):
        with pytest.raises(FrozenConfigError, match="read-only after validation"):
            setattr(section, name, value)
    spec = resolve_engine(cfg.backend, 2, 1, {"name": "deepspeed", "zero_stage": 3, "offload": "optimizer"})
    assert (spec.name, spec.zero_stage, spec.offload, spec.data_parallel_size, spec.data_parallel_rank) == (
        "deepspeed", 3, "optimizer", 2, 1)
    assert cfg.backend.name == "auto" and cfg.backend.offload is None and cfg.training.lr == 2e-3


def test_help_lists_the_subcommands_and_plan_has_its_own():
    """``memtrain --help`` names every subcommand; ``memtrain plan --help`` gives the planner's own
    options (they were undiscoverable behind the trainer's help)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    run = lambda *args: run_cli(list(args), timeout=120)  # noqa: E731
    # the installed console script itself (the other commands run its function, forked)
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    top = subprocess.run(["memtrain", "--help"], capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": path})
    assert top.returncode == 0
    for command in ("train", "plan", "memory", "export", "plot"):
        assert f"\n  {command} " in top.stdout, command
    typo = run("trian", "--config", "x.yaml")  # a mistyped subcommand is named as one, not as a config key
    assert typo.returncode == 2 and "unknown command 'trian' (did you mean 'train'?)" in typo.stderr
    plan = run("plan", "--help")
    assert plan.returncode == 0 and "--gpu_memory_gib" in plan.stdout and "--world_size" in plan.stdout
    train = run("train", "--help")
    assert train.returncode == 0 and "--training.max_steps" in train.stdout
    # one line per option from the config's own docstrings; the test-only fault flags only with --help_all
    from memtrain.cli_help import field_docs, one_line
    from memtrain.config import Config

    text = " ".join(train.stdout.split())
    assert "Samples per forward/backward on one rank." in text  # training.micro_batch_size's docstring
    assert one_line(field_docs(Config)["backend.offload"])[:40] in text
    lines = train.stdout.splitlines()
    options = sum(line.startswith("  --") for line in lines)
    assert "--faults.kill_at_step" not in train.stdout and options > 50 and len(lines) < 5 * options  # a few lines each
    assert "--faults.memory_budget_mib" in train.stdout  # the docs recommend it
    # sections by their names, not jsonargparse's class names; every first sentence whole
    assert not any(line.startswith("<class ") for line in train.stdout.splitlines())
    assert "\ntraining:\n" in train.stdout and "\ndata.speech:\n" in train.stdout
    assert "a YAML file holding the training section's keys" in text
    unwrapped = text.replace("- ", "-")  # argparse also wraps at a hyphen
    firsts = [one_line(doc) for key, doc in field_docs(Config).items() if not key.startswith("faults.")]
    assert all(f.replace("- ", "-") in unwrapped for f in firsts)  # whole: none cut with "…"
    everything = run("train", "--help_all")
    assert everything.returncode == 0 and "--faults.kill_at_step" in everything.stdout


def test_print_config_prints_what_will_run_and_starts_nothing(tmp_path):
    """``--print_config`` resolves the launcher's world size, the engine, precision and plan the
    run would use and exits 0 without writing the output folder; a bad input gives the run's
    own exit code 2 and message."""
    import yaml

    out = tmp_path / "run"
    cmd = ["train", *TINY_ARGS, "--backend.name", "deepspeed", "--backend.zero_stage", "3", "--output_dir", str(out),
           "--print_config"]
    env = {"WORLD_SIZE": "2"}
    proc = run_cli(cmd, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = yaml.safe_load(proc.stdout)
    assert shown["engine"]["name"] == "deepspeed" and shown["engine"]["zero_stage"] == 3
    assert shown["launcher"]["world_size"] == 2
    t = shown["config"]["training"]
    assert shown["plan"]["per_rank_batch"] == t["global_batch_size"] // 2
    if t["micro_batch_size"] != "auto":
        assert shown["plan"]["gradient_accumulation_steps"] * t["micro_batch_size"] * 2 == t["global_batch_size"]
    assert shown["tokens_per_step"] == t["global_batch_size"] * shown["config"]["data"]["seq_len"]
    assert not out.exists()  # nothing started, nothing written
    bad = run_cli(cmd[:-1] + ["--training.max_step", "2", "--print_config"], env=env, timeout=120)
    assert bad.returncode == 2 and "training.max_steps" in bad.stderr and "Traceback" not in bad.stderr
