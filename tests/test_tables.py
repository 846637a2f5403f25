"""benchmarks/tables.py's statistics: the median's order-statistic interval (its coverage from the
binomial(n, ½) distribution, written out here by hand); the commit each result row records and
the report of results whose measured code changed since (against git itself)."""

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from common import emit  # noqa: E402
import tables  # noqa: E402
from tables import median_interval, overhead_pooled, staleness  # noqa: E402

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def test_the_median_interval_is_the_narrowest_with_95_percent_coverage():
    values = [float(v) for v in range(1, 16)]  # 15 values in order, shuffled below
    shuffled = values[7:] + values[:7]
    # 15 values: P(X ≤ 3) = (1 + 15 + 105 + 455) / 2^15, so the 4th from each end covers 96.5%;
    # the 5th would cover 1 − 2·(576 + 1365)/2^15 = 88.2%, below 95%
    assert median_interval(shuffled) == (4.0, 12.0, pytest.approx(1 - 2 * 576 / 2**15))
    # 7 values: only min and max reach 95% (1 − 2/2^7); fewer than 6 values cannot
    assert median_interval(values[:7]) == (1.0, 7.0, pytest.approx(1 - 2 / 2**7))
    low, high, cover = median_interval(values[:5])
    assert (low, high) == (1.0, 5.0) and cover == pytest.approx(1 - 2 / 2**5) and cover < 0.95


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


@needs_git
def test_a_results_file_is_stale_when_the_code_it_measured_changed(tmp_path):
    """``tables.py stale``: a results file whose newest commit predates a change to memtrain/, to
    benchmarks/common.py or to its own script is named; one whose code is unchanged is not; one
    whose rows record no commit cannot be judged."""
    for path in ("memtrain/loop.py", "benchmarks/common.py", "benchmarks/overhead.py", "benchmarks/solver.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "measured")
    measured = _git(tmp_path, "rev-parse", "HEAD")
    results = tmp_path / "benchmarks" / "results"
    results.mkdir()
    rows = {"overhead-cpu": [{"commit": measured}], "solver_exhaustive-cpu": [{}, {"commit": measured}],
            "compile-cpu": [{"x": 1}]}
    for name, content in rows.items():
        (results / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in content))

    def changed() -> dict:
        return {e["results"]: e["code_changed_since"] for e in staleness(results)}

    assert changed() == {"compile-cpu.jsonl": None, "overhead-cpu.jsonl": False, "solver_exhaustive-cpu.jsonl": False}
    (tmp_path / "benchmarks" / "overhead.py").write_text("x = 2\n")
    _git(tmp_path, "commit", "-qam", "the overhead script changes")
    assert changed() == {"compile-cpu.jsonl": None, "overhead-cpu.jsonl": True, "solver_exhaustive-cpu.jsonl": False}
    (tmp_path / "memtrain" / "loop.py").write_text("x = 2\n")
    _git(tmp_path, "commit", "-qam", "memtrain changes")
    assert changed()["solver_exhaustive-cpu.jsonl"] is True  # measured by benchmarks/solver.py
    report = {e["results"]: e for e in staleness(results)}["solver_exhaustive-cpu.jsonl"]
    assert (report["rows"], report["rows_with_commit"], report["newest_commit"]) == (2, 1, measured)


@needs_git
def test_the_pooled_overhead_leaves_out_rows_measured_before_the_engines_code_changed(tmp_path):
    """``tables.py overhead`` pools an engine's repeats only from rows measured at or after the
    commit that changed its step code; rows without a commit cannot show that and are left out."""
    (tmp_path / "f").write_text("1")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "before")
    before = _git(tmp_path, "rev-parse", "HEAD")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "the engine's step changes")
    change = _git(tmp_path, "rev-parse", "HEAD")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "later")
    later = _git(tmp_path, "rev-parse", "HEAD")
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)

    def row(engine, commit, ratio):
        return {"engine": engine, "plain_settings": "same", "armed_ratio_median": 1.0, "repeats": 6,
                "ratios": [ratio] * 6, **({"commit": commit} if commit else {})}

    rows = [row("ddp", None, 3.0), row("ddp", before, 2.0), row("ddp", change, 1.0), row("ddp", later, 1.0),
            row("fsdp", None, 1.5)]
    (results / "overhead-cpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = overhead_pooled("cpu", results, since={"ddp": change})
    ddp, fsdp = (line for line in table.splitlines() if line.startswith(("| DDP", "| FSDP2")))
    assert "| 6 + 6 | 12, 1.000" in ddp
    assert "| 6 | 6, 1.500" in fsdp  # no change named for FSDP2: every row pools
    assert "| 6 + 6 + 6 + 6 | 24," in overhead_pooled("cpu", results, since={})


@needs_git
def test_an_emitted_row_records_the_commit_it_measured(capsys):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    emit("overhead", "cpu", {"benchmark": "overhead", "ratio_median": 1.0}, save=False)
    row = json.loads(capsys.readouterr().out)
    assert row["commit"] == head.stdout.strip() and row["ratio_median"] == 1.0
    assert isinstance(row["worktree_clean"], bool)


def test_the_families_table_keeps_plans_that_do_not_accumulate_apart(tmp_path, monkeypatch):
    """``tables.py memory_accuracy_families``: a row of a plan that does not accumulate
    (``--accumulation 1``) is its own configuration, shown in its own group, not the newest of the
    same model, engine and AC setting at the default global batch."""
    def row(accumulation, error):
        return {"benchmark": "memory_accuracy_families", "model_type": "llama", "seed": 7, "model_config": {"a": 1},
                "engine": "ddp", "world_size": 2, "precision": "fp32", "activation_checkpointing": "on",
                "gradient_accumulation_steps": accumulation, "relative_error": error, "commit": "abcdef0"}

    (tmp_path / "memory_accuracy-cpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (row(2, 0.01), row(1, 0.2))))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    text = tables.memory_accuracy_families("cpu")
    accumulating, alone = text.split("one micro-batch per step")
    assert "Seed 7:" in accumulating and "| DDP | 1 | 1 | 1.0% | 1.0% | 1.0% | +1.0% | abcdef0 |" in accumulating
    assert "| DDP | 1 | 1 | 20.0% | 20.0% | 20.0% | +20.0% | abcdef0 |" in alone
