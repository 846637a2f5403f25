"""Each benchmark's --quick mode runs and prints the JSON it promises (no timing asserts:
numbers live in the benchmarks, not in tests)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def run_quick(name: str, *extra: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--quick", *extra],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_oom_stress_quick_recovers_without_losing_samples():
    """On the simulated device: recovery lands on a plan that fits and trains the same data with
    the same losses as that plan run by hand; auto never runs out of memory."""
    (row,) = run_quick("oom_stress")
    assert row["ooms"] >= 1 and row["start_plan"] == "16x1" and row["final_plan"] != "16x1"
    assert row["steps_with_other_data_than_static_final_plan"] == 0
    assert row["max_rel_loss_diff_vs_static_final_plan"] < 1e-5
    assert row["auto_ooms"] == 0
    assert row["prediction_error"] and all(abs(e) < 0.15 for e in row["prediction_error"])
    # one repeat: each ratio is that repeat's tokens/s over the best static plan's (not inverted)
    tps, best = row["tokens_per_s"], row["best_static_plan"]
    for key, run in (("ratio_recovered_to_best_static", "recovered"), ("ratio_auto_to_best_static", "auto")):
        assert row[key]["median"] == pytest.approx(tps[run]["median"] / tps[best]["median"]), key


def test_overhead_quick_reports_ratio():
    (row,) = run_quick("overhead")
    assert len(row["ratios"]) == len(row["mean_ratios"]) == row["repeats"] == 1
    assert row["plain_step_s_median"] > 0 and row["memtrain_step_s_median"] > 0
    # the ratio is memtrain's step time over the plain loop's (not inverted, not another repeat's)
    assert row["ratios"] == [pytest.approx(row["memtrain_step_s_median"] / row["plain_step_s_median"])]
    assert row["mean_ratios"] == [pytest.approx(row["memtrain_step_s_mean"] / row["plain_step_s_mean"])]
    assert row["ratio_min"] == row["ratio_median"] == row["ratio_max"] == row["ratios"][0]


def test_checkpoint_io_quick_reports_each_format():
    rows = run_quick("checkpoint_io")
    assert [r["config"] for r in rows] == ["fsdp_async"]
    for row in rows:
        assert row["checkpoints"] == 2 and row["bytes"] > 0 and row["load_s"] > 0
        assert 0 < row["blocked_s_median"] <= row["save_s_median"] + 1e-6


def test_chunked_loss_quick_reports_saved_bytes_and_time():
    (row,) = run_quick("chunked_loss")
    assert row["loss_saved_bytes"]["plain_over_chunked"] >= row["goal_loss_saved_bytes_ratio"]
    assert row["model_saved_bytes"]["chunked"] < row["model_saved_bytes"]["plain"]
    # each repeat's ratio is its chunked step time over its plain one's (not inverted, not mixed up)
    each = row["step_s_each_repeat"]
    ratios = [c / p for p, c in zip(each["plain"], each["chunked"])]
    r = row["ratio_chunked_to_plain_step_s"]
    assert (r["min"], r["max"]) == (pytest.approx(min(ratios)), pytest.approx(max(ratios)))


def test_compile_quick_reports_ratio_and_equal_losses():
    """training.compile end to end (inductor, cold cache): it trains the same losses as eager."""
    (row,) = run_quick("compile")
    assert row["max_rel_loss_diff"] < 1e-3
    assert row["compile_s"] > 0 and 0 < row["ratio_compiled_to_eager"]["median"]


def test_memory_accuracy_quick_is_checked_against_memtracker(cache_dir):
    """The planner's predicted peak against torch's MemTracker count of a real 2-rank step, on
    every engine: within 10% either way (under: an OOM the planner said would not happen; over:
    memory left idle). ZeRO's reduce bucket is sized to the model: with DeepSpeed's default of
    5e8 elements the count is ~2 GB per rank, far above DDP's. Rows are printed, not saved."""
    results = REPO / "benchmarks" / "results"
    before = {p.name: p.stat().st_size for p in results.glob("*")}
    rows = run_quick("memory_accuracy", "--data_cache_dir", cache_dir)
    engines = [r for r in rows if "engine" in r]
    assert [r["engine"] for r in engines] == ["ddp", "fsdp", "zero2", "zero3"]
    for r in engines:
        assert -0.10 <= r["relative_error"] <= 0.10, r
        assert r["measured_bytes"] < 3 * engines[0]["measured_bytes"], r  # no 2 GB bucket
    assert set(rows[-1]["summary"]) == {"ddp", "fsdp", "zero2", "zero3"}
    assert {p.name: p.stat().st_size for p in results.glob("*")} == before
