"""Every trained step recorded exactly once across kills from outside: one worker of a 2-rank run
is SIGKILLed at each boundary of a step in turn (``tests/from_outside.py``), the run is rerun after
each kill, and the finished run's ``metrics.jsonl``, ``summary.json`` and TensorBoard scalars
hold one record per step, equal to those of a run that was never killed."""

import glob
import json
import os
from pathlib import Path

import pytest

from conftest import ENGINES, STEPS, child_exit_codes, launch, read_metrics, tiny_args

pytestmark = pytest.mark.slow

FROM_OUTSIDE = str(Path(__file__).parent / "from_outside.py")
ARGS = ("--training.max_steps", str(STEPS), "--checkpoint.every_steps", "1", "--checkpoint.keep_last", "2",
        "--training.eval_every", "2", "--logging.log_with", "[tensorboard]")
KILLS = [("after_optimizer_step", 2, 1), ("save_before_rename", 3, 0), ("save_after_rename", 4, 0),
         ("commit_to_record", 5, 0), ("in_evaluation", 6, 0), ("in_record_write", 7, 0)]
"""(boundary, step, rank killed), in the order the run meets them; each launch after the first is
the rerun of the one killed before it."""
EXACT = ("loss", "lr", "grad_norm", "batch_fingerprint")
TOTALS = ("steps", "samples_seen", "tokens_seen", "first_loss", "last_loss", "initial_val_loss", "final_val_loss")


def tensorboard_scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard shows the run: every event file read in order, the
    points an earlier file holds at and after a later writer's ``purge_step`` hidden."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = {os.path.dirname(f) for f in glob.glob(str(run / "trackers" / "**" / "events.out.tfevents.*"),
                                                      recursive=True)}
    assert len(folders) == 1, folders
    acc = EventAccumulator(folders.pop())
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.heavy
@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_each_step_is_recorded_once_across_kills_at_every_boundary(tmp_path, reference, cache_dir, engine):
    base_dir = reference(engine, extra=ARGS)
    base = read_metrics(base_dir)
    args = tiny_args(tmp_path, cache_dir, *ENGINES[engine], *ARGS)
    for where, step, rank in KILLS:
        killed = launch(args, script=FROM_OUTSIDE, env={"MEMTRAIN_KILL_AT": f"{where}:{step}:{rank}"}, check=False)
        assert killed.returncode != 0, (where, killed.stderr[-2000:])
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        if where == "commit_to_record":  # the case that lost a record: committed, not recorded
            assert os.path.isdir(tmp_path / "checkpoints" / f"step_{step:08d}")
            assert json.loads(lines[-1])["step"] == step - 1
        if where == "in_record_write":
            assert lines[-1].startswith('{"step": 7') and not lines[-1].endswith("}")
    launch(args)  # the last rerun finishes the run
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # no gap, no duplicate
    for r, b in zip(records, base):
        for key in EXACT:
            assert r[key] == b[key], (r["step"], key)
        assert r.get("val_loss") == b.get("val_loss"), r["step"]
    # each rerun resumed where the kill left it: from step 1, 2, 3 ('latest' still named it), 5 (the
    # killed evaluation's step 6 is trained by the next rerun, whose kill comes after step 7's commit) and 7
    assert [r["step"] for r in records if "resume" in r.get("event", "").split(",")] == [2, 3, 4, 6, 8]
    summary = json.loads((tmp_path / "summary.json").read_text())
    expected = json.loads((base_dir / "summary.json").read_text())
    assert {k: summary[k] for k in TOTALS} == {k: expected[k] for k in TOTALS}
    assert os.path.isfile(tmp_path / "model" / "model.safetensors")
    for tag in ("loss", "lr", "grad_norm"):
        shown = tensorboard_scalars(tmp_path, tag)
        assert [s for s, _ in shown] == list(range(1, STEPS + 1)), (tag, shown)
        assert [v for _, v in shown] == [pytest.approx(b[tag], rel=1e-6) for b in base], tag


@pytest.mark.parametrize("every", ["1", "0"])
def test_a_finished_run_whose_export_failed_makes_it_and_its_summary_on_rerun(tmp_path, reference, cache_dir, every):
    """The disk fills during the final export (ENOSPC from outside): exit 4 naming the folder and
    its free bytes, no model/ and no summary.json (a run that saves no checkpoints saves its last
    step instead, and says so); the rerun makes both from the last checkpoint (the export's marker
    names step 8; the summary's totals are the uninterrupted run's); a second rerun changes nothing."""
    base_dir = reference("ddp", extra=ARGS)
    args = tiny_args(tmp_path, cache_dir, *ENGINES["ddp"], *ARGS, "--checkpoint.every_steps", every)
    failed = launch(args, script=FROM_OUTSIDE, env={"MEMTRAIN_DISK_FULL_IN": "export"}, check=False)
    assert child_exit_codes(failed) >= {4}, failed.stderr[-3000:]
    rank0 = failed.stderr
    assert "exporting the model to" in rank0 and "bytes free" in rank0 and "output_dir" in rank0
    assert ("was saved as a checkpoint instead" in rank0) == (every == "0")
    assert not (tmp_path / "model").exists() and not (tmp_path / "summary.json").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    rerun = launch(args)
    assert "finished training at step 8, but its export and summary.json are missing" in rerun.stderr
    marker = json.loads((tmp_path / "model" / "memtrain_export.json").read_text())
    assert marker["step"] == STEPS and marker["checkpoint"].endswith(f"step_{STEPS:08d}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    expected = json.loads((base_dir / "summary.json").read_text())
    assert {k: summary[k] for k in TOTALS} == {k: expected[k] for k in TOTALS}
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, STEPS + 1))
    before = {n: (tmp_path / n).stat().st_mtime_ns for n in ("summary.json", "metrics.jsonl")}
    again = launch(args)
    assert "already finished" in again.stderr
    assert {n: (tmp_path / n).stat().st_mtime_ns for n in before} == before
