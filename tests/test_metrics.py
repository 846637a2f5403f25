"""In-process tests of the rank-0 metrics writer (memtrain/metrics.py): metrics.jsonl on fresh
runs and resumes, the disabled (non-zero rank) logger, and summary.json."""

from __future__ import annotations

import json

import pytest
import torch

from memtrain.metrics import MetricsLogger


def record(step: int, unit: str = "tokens", **extra) -> dict:
    """A step record with the fields the progress bar reads."""
    return {"step": step, "loss": 1.0 / step, "lr": 1e-3, "micro_batch_size": 2, "gradient_accumulation_steps": 4,
            f"{unit}_per_s": 1000.0 + step, **extra}


def summary(unit: str = "tokens", **extra) -> dict:
    """A run summary with the fields the final line reads."""
    return {"steps": 6, "minutes": 0.5, "first_loss": 2.0, "last_loss": 1.0, "initial_val_loss": 2.5,
            "final_val_loss": 1.5, f"{unit}_per_s": 1234.4, "model_dir": "out/model", "preempted": None, **extra}


def write_lines(path, lines: list[str]) -> None:
    path.write_text("".join(lines), encoding="utf-8")


def old_lines(steps) -> list[str]:
    return [json.dumps(record(s, source="old")) + "\n" for s in steps]


def read_steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_fresh_run_starts_empty(tmp_path):
    """keep_until_step None truncates an existing metrics.jsonl."""
    path = tmp_path / "metrics.jsonl"
    write_lines(path, old_lines(range(1, 4)))
    logger = MetricsLogger(str(tmp_path), True, total_steps=5)
    assert path.read_text() == ""
    logger.finish(summary())


def test_resume_keeps_steps_up_to_checkpoint_in_order(tmp_path):
    """keep_until_step N keeps the lines of steps <= N verbatim and in order and drops later steps."""
    path = tmp_path / "metrics.jsonl"
    lines = old_lines(range(1, 6))
    write_lines(path, lines)
    logger = MetricsLogger(str(tmp_path), True, total_steps=10, initial_step=3, keep_until_step=3)
    assert path.read_text(encoding="utf-8") == "".join(lines[:3])
    logger.finish(summary())


def test_resume_drops_line_cut_short(tmp_path):
    """A last line cut short (invalid JSON) is dropped without error, even of a step <= N."""
    path = tmp_path / "metrics.jsonl"
    lines = old_lines(range(1, 5))
    write_lines(path, lines + [json.dumps(record(5))[:20]])
    logger = MetricsLogger(str(tmp_path), True, total_steps=10, initial_step=5, keep_until_step=5)
    assert path.read_text(encoding="utf-8") == "".join(lines)
    logger.finish(summary())


def test_resume_then_log_holds_each_step_once(tmp_path):
    """After resuming at N and logging N+1…, metrics.jsonl holds every step exactly once, the new records last."""
    path = tmp_path / "metrics.jsonl"
    write_lines(path, old_lines(range(1, 6)) + ['{"step": 6, "lo'])
    logger = MetricsLogger(str(tmp_path), True, total_steps=6, initial_step=3, keep_until_step=3)
    for step in range(4, 7):
        logger.log_step(record(step, source="new"))
    logger.finish(summary())
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["source"] for r in records] == ["old"] * 3 + ["new"] * 3


def test_resume_kept_line_without_newline_is_not_joined(tmp_path):
    """A complete last line missing its newline is kept, and the next record starts on its own line."""
    path = tmp_path / "metrics.jsonl"
    write_lines(path, old_lines([1]) + [json.dumps(record(2))])
    logger = MetricsLogger(str(tmp_path), True, total_steps=3, initial_step=2, keep_until_step=2)
    logger.log_step(record(3))
    logger.finish(summary())
    assert read_steps(path) == [1, 2, 3]


def test_resume_puts_back_the_checkpoints_records_the_file_lacks(tmp_path, caplog):
    """Killed between the commit of step 5 and its record: the checkpoint's records (4, 5) fill the
    file's gap; step 5's gets its checkpoint_saved event; a later step (6) is dropped, a step
    written twice keeps its last line, the file's own lines are kept as they were."""
    path = tmp_path / "metrics.jsonl"
    lines = old_lines(range(1, 5))
    write_lines(path, lines + [json.dumps(record(4, source="again")) + "\n", json.dumps(record(6)) + "\n"])
    carried = [record(4, source="checkpoint"), record(5, source="checkpoint", event="resume",
                                                         plan_changes=[{"event": "resume", "step": 5}])]
    saved = {"event": "checkpoint_saved", "step": 5, "path": "ck/step_00000005", "bytes": 10}
    logger = MetricsLogger(str(tmp_path), True, total_steps=6, initial_step=5, keep_until_step=5, carried=carried,
                           saved_event=saved)
    text = path.read_text(encoding="utf-8")
    assert text.startswith("".join(lines[:3]))
    records = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[3]["source"] == "again" and records[4]["source"] == "checkpoint"
    assert records[4]["event"] == "resume,checkpoint_saved" and records[4]["plan_changes"][-1] == saved
    assert logger.earlier == records and logger.missing == []
    logger.finish(summary())


def test_steps_neither_the_file_nor_the_checkpoint_hold_are_named(tmp_path, caplog):
    """metrics.jsonl removed outside memtrain: the checkpoint's records are kept and the steps
    before them are named in a warning."""
    logger = MetricsLogger(str(tmp_path), True, total_steps=6, initial_step=5, keep_until_step=5,
                           carried=[record(4), record(5)])
    assert logger.missing == [1, 2, 3] and "step(s) 1-3" in caplog.text
    assert read_steps(tmp_path / "metrics.jsonl") == [4, 5]
    logger.finish(summary())


def test_disabled_logger_writes_nothing(tmp_path, capsys):
    """enabled=False (a non-zero rank) neither creates, truncates nor appends files, nor prints."""
    existing = tmp_path / "shared"
    existing.mkdir()
    lines = old_lines(range(1, 4))
    write_lines(existing / "metrics.jsonl", lines)
    logger = MetricsLogger(str(existing), False, total_steps=5)
    logger.log_step({"step": 4})  # not even the progress-bar fields are read
    logger.message("hello")
    logger.finish({})
    assert (existing / "metrics.jsonl").read_text(encoding="utf-8") == "".join(lines)
    assert sorted(p.name for p in existing.iterdir()) == ["metrics.jsonl"]

    absent = tmp_path / "absent"
    MetricsLogger(str(absent), False, total_steps=5, keep_until_step=2).finish({})
    assert not absent.exists()
    assert capsys.readouterr().out == ""


def test_finish_writes_summary_and_prints_line(tmp_path, capsys):
    """finish writes summary.json with the summary and prints the done line with the throughput."""
    logger = MetricsLogger(str(tmp_path), True, total_steps=2)
    logger.log_step(record(1))
    logger.log_step(record(2, val_loss=1.25))
    data = summary()
    logger.finish(data)
    assert json.loads((tmp_path / "summary.json").read_text()) == data
    assert not (tmp_path / "summary.json.tmp").exists()
    out = capsys.readouterr().out
    assert f"{data['steps']} steps" in out
    assert f"{data['tokens_per_s']:.0f} tokens/s" in out
    assert read_steps(tmp_path / "metrics.jsonl") == [1, 2]


def test_finish_preempted_line(tmp_path, capsys):
    """A preempted summary prints the stop line naming the signal and step instead of the done line."""
    logger = MetricsLogger(str(tmp_path), True, total_steps=10)
    data = {"steps": 4, "preempted": "SIGTERM"}
    logger.finish(data)
    assert json.loads((tmp_path / "summary.json").read_text()) == data
    out = capsys.readouterr().out
    assert "stopped by SIGTERM after step 4, saved; rerun the same command to resume" in out and "done" not in out


def test_progress_bar_shows_record_fields(tmp_path):
    """log_step puts loss, lr, plan, tok/s and val on the progress bar."""
    logger = MetricsLogger(str(tmp_path), True, total_steps=2, terminal=True)
    rec = record(1, val_loss=0.75)
    logger.log_step(rec)
    postfix = logger._bar.postfix
    for text in (f"loss={rec['loss']:.4f}", f"lr={rec['lr']:.2e}", "mb×acc=2×4",
                 f"tok/s={rec['tokens_per_s']:.0f}", "val=0.7500"):
        assert text in postfix
    assert logger._bar.n == 1
    logger.finish(summary())


def test_away_from_a_terminal_a_step_line_now_and_then(tmp_path, capsys):
    """Standard error not a terminal (a log file): no progress bar redrawn into it, but one line
    for the first step, per evaluation, per LINE_EVERY_S seconds and at the last step, each with
    that step's fields."""
    logger = MetricsLogger(str(tmp_path), True, total_steps=4, terminal=False)
    capsys.readouterr()
    for step in (1, 2):
        logger.log_step(record(step))
    logger.log_step(record(3, val_loss=0.5))
    logger.log_step(record(4))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1] for line in lines] == [" step 1/4", " step 3/4", " step 4/4"]
    assert "val 0.5000" in lines[1] and f"loss {record(4)['loss']:.4f}" in lines[2] and "\r" not in "".join(lines)
    logger.finish(summary())


def test_record_without_progress_fields_fails_only_when_shown(tmp_path):
    """A record lacking tokens_per_s is refused by the progress bar, but is fine with show=False."""
    logger = MetricsLogger(str(tmp_path), True, total_steps=2)
    logger.log_step({"step": 1}, show=False)
    bad = record(2)
    del bad["tokens_per_s"]
    with pytest.raises(KeyError, match="tokens_per_s"):
        logger.log_step(bad)
    logger.finish(summary())


def test_characters_unit(tmp_path, capsys):
    """unit characters reads characters_per_s in records and summary and labels them char/s and characters/s."""
    logger = MetricsLogger(str(tmp_path), True, total_steps=1, unit="characters", terminal=True)
    rec = record(1, unit="characters")
    assert "tokens_per_s" not in rec
    logger.log_step(rec)
    assert f"char/s={rec['characters_per_s']:.0f}" in logger._bar.postfix
    data = summary(unit="characters")
    logger.finish(data)
    assert json.loads((tmp_path / "summary.json").read_text())["characters_per_s"] == data["characters_per_s"]
    assert f"{data['characters_per_s']:.0f} characters/s" in capsys.readouterr().out
    assert read_steps(tmp_path / "metrics.jsonl") == [1]


def test_mfu_counts_6n_plus_attention_against_the_named_peak():
    """MFU = tokens/s × (6·N + 12·L·d·T) / (peak × devices); peaks by GPU name, unknown → none."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from memtrain.flops import flops_per_token, mfu, peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA L40S") == 362e12 and peak_bf16_flops("NVIDIA L4") == 121e12
    assert peak_bf16_flops("Tesla V100-SXM2-16GB") is None
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=100, n_positions=32))
    n = sum(p.numel() for p in model.parameters())
    per_token = flops_per_token(model, n, 32)
    assert per_token == 6 * n + 12 * 3 * 64 * 32
    assert mfu(1000.0, per_token, 1e12, 2) == pytest.approx(1000 * per_token / 2e12)
    assert mfu(1000.0, None, 1e12, 1) is None and mfu(1000.0, per_token, None, 1) is None
    assert flops_per_token(torch.nn.Linear(2, 2), 6, 32) is None
