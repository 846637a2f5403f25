"""In-process tests of ``memtrain plot`` (memtrain/plot.py) on a synthetic metrics.jsonl, and of
MetricsLogger's Accelerate trackers (``logging.log_with``): TensorBoard read back, unknown names refused."""

from __future__ import annotations

import glob
import json

import pytest

from memtrain import plot
from memtrain.config import ConfigError
from memtrain.metrics import MetricsLogger

GIB = 2 ** 30


def step_record(step: int, mb: int = 4, acc: int = 2, **extra) -> dict:
    """A metrics.jsonl record with the loop's field names (memtrain/records.py)."""
    return {"step": step, "epoch": 0, "loss": 5.0 - 0.3 * step, "lr": 1e-4 * min(step, 5),
            "grad_norm": 1.0 + 0.1 * step, "micro_batch_size": mb, "gradient_accumulation_steps": acc,
            "global_batch_size": mb * acc, "samples_seen": 8 * step, "tokens_seen": 256 * step,
            "tokens_per_s": 1000.0 + 10 * step, "peak_memory_bytes": int((1.0 + 0.05 * step) * GIB),
            "elapsed_s": 0.5 * step, "batch_fingerprint": f"{step:016x}", **extra}


def synthetic_run(run_dir) -> list[dict]:
    """Ten steps under a 2 GiB budget: val_loss before step 1 and on 5 and 10, an OOM shrink 4×2 →
    2×4 with activation checkpointing turned on at 4, a resume at 7 (with a checkpoint at 6)."""
    records = []
    for step in range(1, 11):
        mb, acc = (4, 2) if step < 4 else (2, 4)
        extra = {"activation_checkpointing": "off" if step < 4 else "on", "memory_budget_bytes": 2 * GIB}
        if step == 1:
            extra["initial_val_loss"] = 4.5
        if step in (5, 10):
            extra["val_loss"] = 4.0 - 0.1 * step
        if step == 4:
            extra["event"] = "oom_shrink"
            extra["plan_changes"] = [{"event": "oom_shrink", "old": "4×2", "new": "2×4", "reason": "OOM"}]
        if step == 6:
            extra["event"] = "checkpoint_saved"
        if step == 7:
            extra["event"] = "resume"
            extra["plan_changes"] = [{"event": "resume", "step": 7, "from": "ckpt", "load_s": 0.1}]
        records.append(step_record(step, mb, acc, **extra))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return records


@pytest.fixture
def accelerate_state():
    """Accelerate's PartialState (one CPU process), which its trackers log through, as the loop's
    ProcessState would start it; cleared afterwards if this fixture started it."""
    from accelerate import PartialState

    fresh = not PartialState._shared_state
    yield PartialState(cpu=True)
    if fresh:
        PartialState._reset_state()


def event_lines(ax) -> list:
    return [line for line in ax.get_lines() if line.get_gid() == plot.EVENT_GID]


def test_plot_writes_png_with_panels(tmp_path, capsys):
    """main writes a non-blank PNG at --out and prints its path; exit 0."""
    from matplotlib.image import imread

    synthetic_run(tmp_path)
    png = tmp_path / "out" / "run.png"
    png.parent.mkdir()
    assert plot.main([str(tmp_path), "--out", str(png)]) == 0
    assert capsys.readouterr().out.strip() == str(png)
    image = imread(str(png))
    assert image.ndim == 3 and image.shape[0] >= 600 and image.shape[1] >= 600
    assert float(image[..., :3].std()) > 0.01  # not one flat colour


def test_plot_default_out_and_summary_title(tmp_path, capsys):
    """Without --out the PNG is RUN_DIR/run.png; summary.json's facts go into the title, its steps
    and minutes those of the records (a summary of an earlier segment does not make it stale:
    3 s before the resume at step 7, 5 s after)."""
    records = synthetic_run(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 6, "minutes": 0.05, "backend": "ddp",
                                                       "world_size": 2, "precision": "bf16"}))
    assert plot.main([str(tmp_path)]) == 0
    assert (tmp_path / "run.png").stat().st_size > 10_000
    fig = plot.figure(records, plot.read_summary(str(tmp_path)), title="myrun")
    assert fig._suptitle.get_text() == "myrun, 10 steps in 8 s, ddp × 2, bf16"


def test_figure_draws_events_legend_and_plan(tmp_path):
    """Every panel has one line per event; the legend tells plan change, checkpoint and resume
    apart; the loss panel names the plan where it changes; val_loss and memory in GiB are drawn."""
    records = synthetic_run(tmp_path)
    fig = plot.figure(plot.read_records(str(tmp_path)))
    axes = fig.get_axes()
    assert len(axes) == 4
    for ax in axes:
        assert sorted(line.get_xdata()[0] for line in event_lines(ax)) == [4, 6, 7]
    styles = {line.get_xdata()[0]: (line.get_color(), line.get_linestyle()) for line in event_lines(axes[0])}
    assert len(set(styles.values())) == 3
    legend = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert sorted(legend) == ["checkpoint saved", "loss", "plan change", "resume", "val_loss"]
    plans = [(t.xy[0], t.get_text()) for t in axes[0].texts if t.get_gid() == "memtrain-plan"]
    assert plans == [(1, "4×2"), (4, "2×4 + AC")]
    val = next(line for line in axes[0].get_lines() if line.get_label() == "val_loss")
    assert list(val.get_xdata()) == [0, 5, 10] and val.get_ydata()[0] == 4.5  # before step 1 at step 0
    assert axes[0].get_ylabel() == "loss (nats per token)"
    budget = [line for line in axes[3].get_lines() if line.get_gid() == "memtrain-budget"]
    assert len(budget) == 1 and list(budget[0].get_ydata()) == [2.0, 2.0]
    memory = axes[3].get_lines()[0]
    assert memory.get_ydata()[0] == pytest.approx(records[0]["peak_memory_bytes"] / GIB)
    assert "tokens / s" in axes[2].get_ylabel()


def test_a_simulated_device_is_drawn_in_mib_on_its_own_axis():
    """Under faults.memory_budget_mib the simulated peak and the budget (MiB) get an axis of their
    own at the right; the process's peak keeps the left one in GiB (not a budget line at 0.004 GiB)."""
    from memtrain.plot import figure

    records = [step_record(s, 4, 2, simulated_peak_bytes=(3 + s / 10) * 2**20, memory_budget_bytes=4 * 2**20)
               for s in range(1, 4)]
    fig = figure(records)
    left, right = fig.axes[3], fig.axes[4]
    assert left.get_ylabel() == "peak memory (GiB)" and right.get_ylabel() == "simulated device (MiB)"
    assert left.get_lines()[0].get_ydata()[0] == pytest.approx(records[0]["peak_memory_bytes"] / GIB)
    simulated = next(line for line in right.get_lines() if line.get_label() == "simulated_peak_bytes")
    assert list(simulated.get_ydata()) == pytest.approx([3.1, 3.2, 3.3])
    budget = [line for line in right.get_lines() if line.get_gid() == "memtrain-budget"]
    assert len(budget) == 1 and list(budget[0].get_ydata()) == [4.0, 4.0]
    assert not [line for line in left.get_lines() if line.get_gid() == "memtrain-budget"]


def test_events_split_comma_separated_names():
    """An ``event`` of two names gives two marks of their own kinds; characters_per_s is found."""
    records = [step_record(1, event="plan_chosen,checkpoint_saved"), step_record(2, event="nonfinite_skip")]
    assert plot.events(records) == [(1, "plan_chosen"), (1, "checkpoint_saved"), (2, "nonfinite_skip")]
    assert [plot.event_kind(n) for _, n in plot.events(records)] == ["plan", "checkpoint", "other"]
    speech = [{"step": 1, "loss": 1.0, "characters_per_s": 50.0}]
    assert plot.throughput_key(speech) == "characters_per_s"


@pytest.mark.parametrize("case", ["missing_dir", "no_metrics", "empty", "only_cut_line"])
def test_plot_errors_are_one_line_exit_2(tmp_path, capsys, case):
    """A missing run dir, a dir without metrics.jsonl, or one without any complete record: exit 2, one line."""
    run_dir = tmp_path / "run"
    if case != "missing_dir":
        run_dir.mkdir()
    if case == "empty":
        (run_dir / "metrics.jsonl").write_text("")
    if case == "only_cut_line":
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "lo')
    assert plot.main([str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memtrain plot: ") and str(run_dir) in lines[0]
    assert not (run_dir / "run.png").exists()


def test_tensorboard_tracker_gets_the_scalars(tmp_path, accelerate_state):
    """log_with tensorboard: each record's numeric fields at its step under output_dir/trackers;
    the fingerprint, strings and lists are not tags; metrics.jsonl is written as without trackers."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(str(tmp_path), True, 3, log_with=["tensorboard"])
    records = [step_record(s, event="resume", plan_changes=[{"event": "resume"}]) if s == 2 else step_record(s)
               for s in (1, 2, 3)]
    for rec in records:
        logger.log_step(rec)
    logger.finish({"steps": 3, "preempted": "SIGTERM"})
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == records
    event_files = glob.glob(str(tmp_path / "trackers" / "**" / "events.out.tfevents.*"), recursive=True)
    assert len(event_files) == 1
    acc = EventAccumulator(event_files[0])
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    every_tag = {tag.split("/")[0] for kind in acc.Tags().values() if isinstance(kind, list) for tag in kind}
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(r["step"], pytest.approx(r["loss"])) for r in records]
    assert {"lr", "grad_norm", "tokens_per_s", "peak_memory_bytes", "micro_batch_size"} <= tags
    assert not every_tag & {"batch_fingerprint", "event", "plan_changes", "step"}


def test_unknown_tracker_is_a_config_error(tmp_path):
    """An unknown log_with name raises ConfigError naming logging.log_with and the choices; nothing written."""
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="logging.log_with") as info:
        MetricsLogger(str(run_dir), True, 3, log_with=["nonexistent"])
    assert info.value.field == "logging.log_with"
    assert "tensorboard" in str(info.value) and "nonexistent" in str(info.value)
    with pytest.raises(ConfigError, match="logging.log_with"):  # every rank refuses it alike
        MetricsLogger(str(run_dir), False, 3, log_with=["nonexistent"])
    assert not run_dir.exists()


def test_disabled_logger_starts_no_tracker(tmp_path):
    """A non-zero rank (enabled=False) with log_with tensorboard writes no tracker files."""
    logger = MetricsLogger(str(tmp_path / "run"), False, 3, log_with=["tensorboard"])
    logger.log_step(step_record(1))
    logger.finish({})
    assert not (tmp_path / "run").exists()


def test_tracker_without_its_package_names_the_install(tmp_path, monkeypatch, accelerate_state):
    """A known tracker whose package is missing raises ConfigError saying what to install."""
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "_available_trackers", [])
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        MetricsLogger(str(tmp_path / "run"), True, 3, log_with=["tensorboard"])
    with pytest.raises(ConfigError, match="no tracker package"):
        MetricsLogger(str(tmp_path / "run"), True, 3, log_with=["all"])
    assert not (tmp_path / "run").exists()
