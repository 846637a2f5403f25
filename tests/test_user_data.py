"""Nothing of the user's is deleted or silently changed: export targets, a run folder two runs
share, settings changed on resume, a finished run rerun. Each case asserts the documented exit
code, the message, and that the files on disk are as they were.

One finished 1-process run (4 steps, checkpoints at 2 and 4) is shared by every test here; the
tests that change a run work on copies of it.
"""

import hashlib
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import conftest
from conftest import REPO, made_once, read_metrics, shared_dir, tiny_args

BASE = ["--training.max_steps", "4", "--checkpoint.every_steps", "2", "--training.lr", "1e-3",
        "--training.warmup_steps", "2", "--training.min_lr_ratio", "0.1"]


def run_cli(args: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python memtrain/train.py ARGS`` in one process (no launcher), output captured."""
    return conftest.run_cli(args, env=env, timeout=timeout)


def snapshot(folder) -> dict[str, str]:
    """Relative path → sha256 of every file below ``folder`` (the run lock's own file aside)."""
    out = {}
    for base, _, names in os.walk(folder):
        for name in names:
            if name == ".memtrain.lock":
                continue
            path = os.path.join(base, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache_dir):
    """The shared finished run's folder, run once per session (do not modify: copy it)."""
    folder = shared_dir(tmp_path_factory) / "finished"
    with made_once(folder) as make:
        if make:
            proc = run_cli(tiny_args(folder / "run", cache_dir, *BASE))
            assert proc.returncode == 0, proc.stderr[-4000:]
    return folder / "run"


def copy_run(finished_run, tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(finished_run, target)
    return target


# -- export: the deleting cases first -------------------------------------------------------------
def test_export_never_removes_what_it_did_not_write(finished_run, tmp_path, capsys):
    """A folder holding the user's notes, the run folder itself, a folder inside it: refused
    (exit 2, the target named), nothing changed. A new folder and an earlier export: written."""
    from memtrain.export import main as export_main

    run = copy_run(finished_run, tmp_path)
    before = snapshot(run)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "ideas.txt").write_text("do not lose me")
    (tmp_path / "exported.tmp").mkdir()  # a user's folder that the old export removed as its scratch space
    (tmp_path / "exported.tmp" / "keep.txt").write_text("mine")
    for ckpt, out, phrase in [(run, notes, "is not empty and is not an earlier memtrain export"),
                              (run, run, "is the folder"),
                              (run / "checkpoints", run / "exported", "is inside folder"),
                              (run / "checkpoints" / "step_00000004", run / "checkpoints", "is inside folder")]:
        capsys.readouterr()
        assert export_main([str(ckpt), str(out)]) == 2
        err = capsys.readouterr().err
        assert phrase in err and str(out) in err, err
        assert (notes / "ideas.txt").read_text() == "do not lose me"
        assert snapshot(run) == before
    exported = tmp_path / "exported"
    assert export_main([str(run), str(exported)]) == 0
    first = snapshot(exported)
    assert "model.safetensors" in first and "memtrain_export.json" in first
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(exported).model_max_length == 32  # the model's positions
    assert export_main([str(run / "checkpoints" / "step_00000002"), str(exported)]) == 0  # an earlier export: replaced
    assert snapshot(exported)["model.safetensors"] != first["model.safetensors"]
    assert (tmp_path / "exported.tmp" / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["exported", "exported.tmp", "notes", "run"]  # no scratch folder left
    (exported / "my_eval.json").write_text("{}")  # the user's file inside an export: that export is theirs now
    assert export_main([str(run), str(exported)]) == 2
    assert (exported / "my_eval.json").exists() and snapshot(run) == before


def test_export_takes_only_its_marker_for_an_export_and_follows_links(finished_run, tmp_path, capsys):
    """A transformers model of the user's (an export's files, no marker) and a folder holding only
    the user's config.json: refused, unchanged. A link to an earlier export: the export lands where
    it points and the link stays. A bad --max_shard_size: refused before anything is written.
    Files and folders get the user's umask (not mkdtemp's 0700 nor a library's 0600)."""
    from memtrain.export import main as export_main

    run = copy_run(finished_run, tmp_path)
    hf = tmp_path / "my_hf_model"
    shutil.copytree(run / "model", hf)
    (hf / "memtrain_export.json").unlink()
    mine = tmp_path / "my_config"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "mine"}')
    for out in (hf, mine):
        before = snapshot(out)
        assert export_main([str(run), str(out)]) == 2
        assert "is not an earlier memtrain export" in capsys.readouterr().err
        assert snapshot(out) == before
    for size in ("abc", "-5GB"):  # -5GB: huggingface_hub would write one shard per tensor
        assert export_main([str(run), str(tmp_path / "new"), f"--max_shard_size={size}"]) == 2
        assert "--max_shard_size" in capsys.readouterr().err and not (tmp_path / "new").exists()
    earlier = tmp_path / "earlier"
    old_mask = os.umask(0o027)
    try:
        assert export_main([str(run / "checkpoints" / "step_00000002"), str(earlier)]) == 0
        os.symlink(earlier, tmp_path / "link")
        first = snapshot(earlier)
        assert export_main([str(run), str(tmp_path / "link")]) == 0
    finally:
        os.umask(old_mask)
    assert os.path.islink(tmp_path / "link") and os.path.realpath(tmp_path / "link") == str(earlier)
    assert snapshot(earlier)["model.safetensors"] != first["model.safetensors"]  # step 4's weights, in place
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no scratch or replaced folder left
    assert oct(os.stat(earlier).st_mode & 0o777) == oct(0o750)
    assert {oct(os.stat(earlier / n).st_mode & 0o777) for n in os.listdir(earlier)} == {oct(0o640)}


def test_a_run_refuses_a_folder_holding_the_users_files_of_its_names(finished_run, tmp_path):
    """output_dir holding the user's own metrics.jsonl (no lock file, no checkpoint): exit 2
    naming it, nothing written; a copy of a run without its hidden lock file is still a run's."""
    mine = tmp_path / "my_results"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text('{"step": 1, "accuracy": 0.93}\n')
    proc = run_cli(tiny_args(mine, "unused", *BASE))
    assert proc.returncode == 2 and "metrics.jsonl" in proc.stderr and "'output_dir'" in proc.stderr, proc.stderr
    assert os.listdir(mine) == ["metrics.jsonl"]
    from memtrain.checkpoint.layout import check_run_folder

    run = copy_run(finished_run, tmp_path)
    (run / ".memtrain.lock").unlink()
    check_run_folder(str(run))  # its checkpoints say whose it is


def test_a_run_does_not_export_over_files_it_did_not_write(finished_run, tmp_path):
    """output_dir/model holding the user's file: refused before anything is written (exit 2)."""
    run = copy_run(finished_run, tmp_path)
    (run / "model" / "README.md").write_text("my model card")
    before = snapshot(run)
    proc = run_cli(tiny_args(run, "unused", *BASE, "--resume", "never"))
    assert proc.returncode == 2 and "'output_dir'" in proc.stderr and "README.md" in proc.stderr, proc.stderr
    assert snapshot(run) == before


# -- one run folder, one run ---------------------------------------------------------------------
HOLD = """
import sys, time
from memtrain.folders import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_in_a_held_folder_is_refused_and_a_dead_holder_taken_over(finished_run, tmp_path, cache_dir):
    """A live holder: the second start exits 2 naming its PID, nothing written. Once the holder
    is killed (its lock file left behind), a start takes the lock over and says whose it was."""
    run = copy_run(finished_run, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run)
        proc = run_cli(tiny_args(run, cache_dir, *BASE, "--training.max_steps", "6"))
        assert proc.returncode == 2, proc.stderr
        assert "is in use by another memtrain run" in proc.stderr and f"PID {holder.pid} " in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and snapshot(run) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert str(holder.pid) in (run / ".memtrain.lock").read_text()  # left by the dead holder
    proc = run_cli(tiny_args(run, cache_dir, *BASE))  # finished already: changes nothing
    assert proc.returncode == 0, proc.stderr
    assert "taking over the lock" in proc.stderr and f"PID {holder.pid} " in proc.stderr, proc.stderr
    assert (run / ".memtrain.lock").read_text() == ""  # released


# -- a finished run rerun ------------------------------------------------------------------------
@pytest.mark.parametrize("max_steps,phrase", [("4", "already finished at step 4"),
                                              ("2", "is at step 4, past training.max_steps 2")])
def test_rerunning_a_finished_run_changes_nothing(finished_run, tmp_path, cache_dir, max_steps, phrase):
    run = copy_run(finished_run, tmp_path)
    before = snapshot(run)
    proc = run_cli(tiny_args(run, cache_dir, *BASE, "--training.max_steps", max_steps))
    assert proc.returncode == 0, proc.stderr
    assert phrase in proc.stderr and "nothing changed" in proc.stderr, proc.stderr
    assert "tokens/s" not in proc.stdout + proc.stderr
    assert snapshot(run) == before


# -- changed settings on resume ------------------------------------------------------------------
def expected_lr(step: int, lr: float, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Linear warm-up then cosine decay, written out here (not taken from memtrain.optim)."""
    done = step - 1  # optimizer steps taken before this one
    if done < warmup:
        return lr * (done + 1) / warmup
    progress = min(1.0, (done - warmup) / (max_steps - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def test_changed_settings_on_resume_take_effect_and_are_recorded(finished_run, tmp_path, cache_dir):
    """max_steps, lr, adam_beta2 and micro_batch_size changed: the log and the resume event say
    so, the schedule is the new one from step 5, the plan restarts at the new micro-batch, and
    summary.json and the new manifests record what trained. A must-match setting is refused."""
    import json

    run = copy_run(finished_run, tmp_path)
    refused = run_cli(tiny_args(run, cache_dir, *BASE, "--training.max_steps", "6", "--training.seed", "7"))
    assert refused.returncode == 2 and "'training.seed'" in refused.stderr and "1234" in refused.stderr, refused.stderr
    changed = ["--training.max_steps", "6", "--training.lr", "3e-3", "--training.adam_beta2", "0.99",
               "--training.micro_batch_size", "4"]
    proc = run_cli(tiny_args(run, cache_dir, *BASE, *changed))
    assert proc.returncode == 0, proc.stderr
    assert "training.lr 0.001 → 0.003" in proc.stderr and "training.max_steps 4 → 6" in proc.stderr, proc.stderr
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    resume = records[4]["plan_changes"][0]
    assert resume["event"] == "resume" and resume["changed"]["training.lr"] == [1e-3, 3e-3]
    assert resume["changed"]["training.adam_beta2"] == [0.95, 0.99]
    for r in records[:4]:
        assert r["lr"] == pytest.approx(expected_lr(r["step"], 1e-3, 2, 4, 0.1), rel=1e-9)
    for r in records[4:]:
        assert r["lr"] == pytest.approx(expected_lr(r["step"], 3e-3, 2, 6, 0.1), rel=1e-9)
        assert r["micro_batch_size"] == 4 and r["gradient_accumulation_steps"] == 2
    summary = json.loads((run / "summary.json").read_text())
    manifest = json.loads((run / "checkpoints" / "step_00000006" / "manifest.json").read_text())
    for config in (summary["config"], manifest["config"]):
        assert config["training"]["lr"] == 3e-3 and config["training"]["adam_beta2"] == 0.99
    # totals over both segments: saves at steps 2 and 4 (the first run) and 6, one resume, no plan change
    assert summary["events"] == {"checkpoint_saved": 3, "resume": 1} and summary["plan_changes"] == 0
    first_minutes = records[3]["elapsed_s"] / 60
    assert summary["minutes"] == pytest.approx(first_minutes + records[5]["elapsed_s"] / 60)
    assert summary["tokens_seen"] == records[5]["tokens_seen"] and summary["samples_seen"] == records[5]["samples_seen"]
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens_seen"] / (summary["minutes"] * 60))
    assert summary["engine_spec"]["name"] == "ddp" and summary["engine_spec"]["data_parallel_size"] == 1
    # the same resume without the change trains other weights: the change reached the optimizer
    same = copy_run(finished_run, tmp_path / "same")
    assert run_cli(tiny_args(same, cache_dir, *BASE, "--training.max_steps", "6",
                             "--training.micro_batch_size", "4")).returncode == 0
    assert read_metrics(same)[5]["loss"] != records[5]["loss"]


def test_every_setting_has_a_resume_class():
    """Every key of the config is must-match or takes-effect; none is left unclassified."""
    from memtrain.checkpoint.compat import ResumeRules
    from memtrain.config import Config, to_dict
    from memtrain.levers import LEVERS, resume_rules

    rules = ResumeRules.with_levers(resume_rules())
    classes = rules.classes(to_dict(Config()))
    assert set(rules.must_match) <= set(classes) and set(rules.takes_effect) <= set(classes)
    assert not set(rules.must_match) & set(rules.takes_effect)
    assert {"training.global_batch_size", "data.seq_len", "data.encoding", "backend.name",
            "optimizer.state_dtype"} <= {k for k, v in classes.items() if v == "must_match"}
    assert classes["training.lr"] == classes["checkpoint.every_steps"] == "takes_effect"
    assert {x.config_key for x in LEVERS if x.on_resume == "restarts_plan"} <= set(rules.takes_effect)
    documented = (REPO / "docs" / "checkpoints.md").read_text()
    assert all(f"`{key}`" in documented for key in (*rules.must_match, *rules.takes_effect))  # the docs list both


def test_a_skipped_checkpoint_is_named_with_the_reason(tmp_path, caplog):
    """resume auto past a checkpoint without a manifest (or with a damaged one): the log names it and why."""
    from memtrain.checkpoint.layout import choose_resume
    from test_checkpoint_layout import save

    root = tmp_path / "checkpoints"
    save(root, 2)
    save(root, 4)
    os.remove(root / "step_00000004" / "manifest.json")
    (root / "step_00000006").mkdir()  # a save that never finished
    assert choose_resume(str(root), "auto").endswith("step_00000002")
    for step in ("step_00000004", "step_00000006"):
        assert any(step in m and "has no manifest.json" in m and "resuming from step 2" in m for m in caplog.messages)


# -- the user's mistakes are exit 2, naming what to fix -------------------------------------------
def exit_of(argv: list[str]) -> tuple[int, str]:
    """The exit code and message the ``memtrain`` command gives for ``argv``, in this process."""
    from memtrain.train import error_report, main

    try:
        main(argv)
    except Exception as exc:  # noqa: BLE001
        return error_report(exc, None)
    return 0, ""


def test_user_mistakes_exit_2_naming_the_field_or_file(tmp_path, cache_dir, monkeypatch):
    from conftest import TINY_ARGS

    recipe = tmp_path / "twice.yaml"
    recipe.write_text((REPO / "recipes" / "code_lm_tiny.yaml").read_text() + "training:\n  max_steps: 3\n")
    commented = tmp_path / "commented.json"
    commented.write_text('{\n  // ZeRO-2\n  "zero_optimization": {"stage": 2}\n}\n')
    trailing = tmp_path / "trailing.json"
    trailing.write_text('{\n  "zero_optimization": {"stage": 2},\n}\n')
    fp16 = tmp_path / "fp16.json"
    fp16.write_text('{"fp16": {"enabled": true}, "zero_optimization": {"stage": 2}}\n')
    one_file = tmp_path / "only.txt"
    one_file.write_text("def f():\n    return 1\n" * 200)
    (tmp_path / "a_file").write_text("x")
    out = tmp_path / "out"
    cases = [
        (["--config", str(recipe)], "config", f"{recipe}: key 'training' is given twice (first at line"),
        (["--model.config.n_layer", "four"], "model.config.n_layer", "expects an integer"),
        (["--model.config.n_layr", "2"], "model.config.n_layr", "not a setting of transformers' GPT2Config "
         "(model_type gpt2), which would keep it unused; did you mean n_layer"),
        (["--model.config.n_embd", "100", "--model.config.n_head", "3"], "model.config", "divisible"),
        (["--model.config.model_type", "gtp2"], "model.config.model_type", "close matches: gpt2"),
        (["--backend.deepspeed_config", str(commented)], "backend.deepspeed_config", f"{commented} is not valid JSON"),
        (["--backend.deepspeed_config", str(trailing)], "backend.deepspeed_config", "line 3"),
        (["--backend.deepspeed_config", str(fp16), "--precision", "auto"], "backend.deepspeed_config",
         "fp16.enabled = true, which needs a CUDA"),
        (["--checkpoint.max_shard_size", "abc"], "checkpoint.max_shard_size", "'abc' is not a size"),
        (["--data.files", f"[{one_file}]"], "data.files", "at least two are needed"),
        (["--training.learning_rate", "1e-4"], "training.learning_rate", "did you mean 'training.lr'"),
        (["--data.encoding", "latin-9000"], "data.encoding", "not an encoding Python knows"),
    ]
    for extra, field, phrase in cases:
        code, message = exit_of(TINY_ARGS + ["--output_dir", str(out), "--data.cache_dir", cache_dir, *extra])
        assert code == 2 and f"'{field}'" in message and phrase in message, (extra, code, message)
        assert len(message) < 600, message  # one readable line, not a library's list of every choice
        assert not out.exists()  # nothing written
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "a_file" / "cache"))
    code, message = exit_of(TINY_ARGS + ["--output_dir", str(out)])
    assert code == 2 and "'MEMTRAIN_CACHE'" in message and "cannot be written" in message, message


def test_a_speech_manifest_naming_a_missing_clip_is_named(tmp_path):
    from memtrain.config import ConfigError
    from memtrain.data.speech import read_manifests

    manifest = tmp_path / "train.jsonl"
    manifest.write_text('{"audio": "missing.wav", "text": "hello"}\n')
    with pytest.raises(ConfigError) as info:
        read_manifests([str(manifest)])
    assert info.value.field == "data.files" and f"{manifest}:1: audio file" in str(info.value)


def test_text_that_is_not_utf8_is_counted_named_and_refused(tmp_path, caplog):
    """A latin-1 file: exit 2 naming it and data.encoding; read as latin-1 with data.encoding. A
    file with one stray byte: trained, and named in a warning, again when the cache is reused."""
    from memtrain.config import ConfigError, DataConfig
    from memtrain.data import build_corpus

    text = "def add(a, b):\n    return a + b  # la somme\n" * 400
    (tmp_path / "a.py").write_text(text)
    (tmp_path / "b.py").write_text(text.replace("somme", "s\u00f6mme\u00e9"), encoding="latin-1")
    data = DataConfig(files=[str(tmp_path / "*.py")], vocab_size=300, seq_len=16, cache_dir=str(tmp_path / "cache"),
                      validation_fraction=0.5)
    with pytest.raises(ConfigError) as info:
        build_corpus(data)
    assert info.value.field == "data.encoding" and "b.py" in str(info.value) and "latin-1" in str(info.value)
    assert not [n for n in os.listdir(tmp_path / "cache") if not n.startswith(".")]  # no cache kept
    data.encoding = "latin-1"
    assert len(build_corpus(data).train) > 0
    (tmp_path / "b.py").write_bytes(text.encode() + b"\xff")  # one byte in ~19,000
    data.encoding = "utf-8"
    for _ in range(2):  # built, then reused from the cache
        warnings = build_corpus(data).tokenized.decode_warnings
        assert len(warnings) == 1 and "b.py" in warnings[0] and "1 of" in warnings[0], warnings


def test_rerunning_a_finished_run_without_checkpoints_is_refused_not_trained_over(finished_run, tmp_path, cache_dir):
    """A finished run that saved no checkpoint (``checkpoint.every_steps 0``) cannot be resumed:
    rerunning it with ``resume auto`` is refused (exit 2, ``output_dir`` and the way out named)
    and changes nothing, where it used to train again over its metrics, summary and model;
    ``resume never`` then trains again with the earlier outputs moved aside, byte for byte."""
    run = copy_run(finished_run, tmp_path)
    shutil.rmtree(run / "checkpoints")  # what every_steps 0 leaves
    before = snapshot(run)
    code, message = exit_of(tiny_args(run, cache_dir, *BASE))
    assert code == 2 and "'output_dir'" in message and "--resume never" in message, message
    assert snapshot(run) == before
    assert exit_of(tiny_args(run, cache_dir, *BASE, "--resume", "never")) == (0, "")
    moved = [p for p in run.iterdir() if p.name.startswith("previous_run_")]
    assert len(moved) == 1 and snapshot(moved[0]) == before


def test_resume_never_with_bad_data_leaves_the_previous_run_in_place(finished_run, tmp_path, cache_dir):
    """The previous run is moved aside only once the new run's data is good: a refused data file
    (exit 2) leaves the folder exactly as it was."""
    run = copy_run(finished_run, tmp_path)
    (tmp_path / "a.py").write_text("x = 1\n" * 500)
    (tmp_path / "b.py").write_bytes(b"y = '\xe9\xe8'\n" * 500)
    before = snapshot(run)
    code, message = exit_of(tiny_args(run, cache_dir, *BASE, "--resume", "never", "--data.max_bytes", "0",
                                      "--data.files", f"[{tmp_path}/*.py]"))
    assert code == 2 and "'data.encoding'" in message and "b.py" in message, message
    assert snapshot(run) == before


def test_a_full_disk_in_the_export_is_named_whatever_the_library_raises(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError, not an OSError: still an
    OutputError (exit 4) naming the folder and its free bytes; nothing is left beside it. Another
    error stays what it is."""
    import torch
    from safetensors import SafetensorError

    import memtrain.export as export
    from memtrain.errors import OutputError

    def full(*args):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No "
                              "space left on device\" })")
    monkeypatch.setattr(export, "_write_export", full)
    with pytest.raises(OutputError, match="the disk is full .* bytes free"):
        export.export_model(torch.nn.Linear(2, 2), {}, str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(export, "_write_export", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        export.export_model(torch.nn.Linear(2, 2), {}, str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def test_a_stopped_export_says_so_and_leaves_no_scratch_folder(finished_run, tmp_path, capsys, caplog, monkeypatch):
    """SIGTERM while the export writes (sent by the process to itself from inside the writer, the
    moment a scheduler's stop would land): exit 143, one line saying nothing was written, the
    earlier export untouched and no temporary folder left. A killed export's folder (its process
    gone: SIGKILL cannot be caught) is removed by the next export to the same place, and named."""
    from memtrain import export
    from memtrain.folders import new_export_folder

    run = copy_run(finished_run, tmp_path)
    exported = tmp_path / "exported"
    assert export.main([str(run / "checkpoints" / "step_00000002"), str(exported)]) == 0
    before = snapshot(exported)
    write = export._write_export

    def stopped_midway(model, state_dict, tmp, tokenizer, max_shard_size):
        write(model, state_dict, tmp, tokenizer, max_shard_size)  # the files are in the scratch folder
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(export, "_write_export", stopped_midway)
    capsys.readouterr()
    handler = signal.getsignal(signal.SIGTERM)
    assert export.main([str(run), str(exported)]) == 143
    assert "stopped by SIGTERM; nothing was written to" in capsys.readouterr().err
    assert snapshot(exported) == before and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert signal.getsignal(signal.SIGTERM) is handler  # the command's handlers are undone
    monkeypatch.undo()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a process that is gone, as a killed export's is
    left = tmp_path / f".tmp-exported-{dead}-abc123"
    left.mkdir()
    (left / "model.safetensors").write_text("half")
    alive = Path(new_export_folder(str(tmp_path / "exported")))  # this process's: kept until it is done
    assert export.main([str(run), str(exported)]) == 0
    assert not left.exists() and alive.exists() and snapshot(exported) != before
    assert f"removed {left}" in caplog.text
