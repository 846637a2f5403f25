"""The GPU suite's parts (benchmarks/gpu_suite.py): each fits its nine minutes, and a part cut
short resumes where it stopped, keeping every row written before the cut (no GPU needed: stand-in
steps on the CPU)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_suite  # noqa: E402
from gpu_suite import PART_BUDGET_S, STATUS, Step, main  # noqa: E402


def test_list_gives_each_steps_part_and_limit_and_each_part_fits_nine_minutes():
    out = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--list"], capture_output=True, text=True,
                         cwd=REPO, timeout=60, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert {tuple(sorted(r)) for r in rows} == {("limit_s", "part", "step")}
    for part in (1, 2):
        assert 0 < sum(r["limit_s"] for r in rows if r["part"] == part) <= 540 == PART_BUDGET_S
    first = {r["step"] for r in rows if r["part"] == 1}
    assert {"cuda_tests", "oom_stress", "memory_accuracy"} == first  # the mission's headline comes first
    oom = next(s for s in gpu_suite.STEPS if s.name == "oom_stress")
    assert "ddp,fsdp,zero3" in oom.cuda and "12" in oom.cuda  # the 355M model under a 12 GiB cap, three engines
    assert all(r["part"] in (1, 2) for r in rows if r["limit_s"] > 0)  # every GPU step is in a part


def _writer(name: str, sleep_s: float) -> tuple[str, ...]:
    """A stand-in step: one result row through the benchmarks' own ``emit``, then ``sleep_s``."""
    return ("-c", "import sys, time; sys.path.insert(0, 'benchmarks'); from common import emit; "
                  f"emit('{name}', 'cpu', {{'value': 1}}, '--results' in sys.argv); time.sleep({sleep_s})")


@pytest.mark.timeout(120)
def test_a_cut_part_keeps_its_rows_and_resumes_where_it_stopped(tmp_path, monkeypatch):
    """Run 1: the first step writes its row and is cut at the time limit (its row stays, its status
    says so); the budget is then spent, so the second step never starts. Run 2 into the same folder
    skips the first step (still reported as failed) and runs the second; no row is written twice or
    lost. A step whose run was cut by the machine's loss (a ``started`` status and no end) is not
    run again either: its rows are kept, not duplicated."""
    steps = (Step("slow", None, _writer("slow", 60), 400, part=1), Step("fast", None, _writer("fast", 0), 100, part=1))
    monkeypatch.setattr(gpu_suite, "STEPS", steps)
    out = tmp_path / "out"
    args = ["--device", "cpu", "--quick", "--part", "1", "--out", str(out)]
    assert main(args + ["--budget_s", "6"]) == 1  # the slow step ran out of time
    assert [json.loads(line)["value"] for line in (out / "slow-cpu.jsonl").read_text().splitlines()] == [1]
    assert not (out / "fast-cpu.jsonl").exists()
    started, ended = [json.loads(line) for line in (out / STATUS).read_text().splitlines()]
    assert started == {"step": "slow", "part": 1, "started": True, **{k: started[k] for k in ("commit", "worktree_clean")}}
    assert ended["step"] == "slow" and ended["timed_out"] and ended["part"] == 1 and "commit" in ended
    assert main(args + ["--budget_s", "60"]) == 1  # the earlier run's failure is still reported
    assert len((out / "slow-cpu.jsonl").read_text().splitlines()) == 1  # not run again
    assert [json.loads(line)["value"] for line in (out / "fast-cpu.jsonl").read_text().splitlines()] == [1]
    assert [json.loads(line)["step"] for line in (out / STATUS).read_text().splitlines()] == ["slow"] * 2 + ["fast"] * 2
    cut = tmp_path / "cut"  # the machine was taken back inside "fast": a started row, a row written, no end
    cut.mkdir()
    (cut / STATUS).write_text(json.dumps({"step": "fast", "part": 1, "started": True}) + "\n")
    (cut / "fast-cpu.jsonl").write_text(json.dumps({"value": 1}) + "\n")
    monkeypatch.setattr(gpu_suite, "STEPS", steps[1:])
    assert main(["--device", "cpu", "--quick", "--part", "1", "--out", str(cut)]) == 1  # cut: not a success
    assert len((cut / "fast-cpu.jsonl").read_text().splitlines()) == 1


def test_only_stays_inside_the_part():
    with pytest.raises(SystemExit):
        main(["--part", "1", "--only", "overhead", "--device", "cpu", "--quick"])  # overhead is in part 2


def test_merge_appends_new_rows_only(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "out" / "overhead-gpu.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    (tmp_path / "out" / STATUS).write_text('{"step": "overhead"}\n')
    (tmp_path / "results" / "overhead-gpu.jsonl").write_text('{"a": 1}\n')
    assert gpu_suite.merge(tmp_path / "out", tmp_path / "results") == {"overhead-gpu.jsonl": 1}
    assert (tmp_path / "results" / "overhead-gpu.jsonl").read_text() == '{"a": 1}\n{"a": 2}\n'
    assert not (tmp_path / "results" / STATUS).exists()


def test_a_gpu_table_names_its_hardware_and_commit_and_says_when_it_is_stale():
    entry = {"results": "overhead-nvidia-h100-80gb-hbm3.jsonl", "rows": 6, "rows_with_commit": 6,
             "newest_commit": "0123456789abcdef", "code_changed_since": True}
    note = gpu_suite.provenance_note(entry, "nvidia-h100-80gb-hbm3")
    assert "nvidia-h100-80gb-hbm3" in note and "0123456789" in note and "**stale**" in note
    assert "stale" not in gpu_suite.provenance_note({**entry, "code_changed_since": False}, "nvidia-h100-80gb-hbm3")
    assert "stale" in gpu_suite.provenance_note({**entry, "newest_commit": None, "code_changed_since": None}, "h100")


def test_bad_inputs_are_refused_before_any_step_runs(tmp_path, monkeypatch, capsys):
    """No CUDA device with ``--device cuda`` (the default), and an ``--out`` that cannot be
    written: exit 2 at once, naming the option, no traceback and no step run."""
    ran = []
    monkeypatch.setattr(gpu_suite, "run_step", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(gpu_suite, "cuda_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        main(["--part", "1", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2 and "no CUDA device" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as stop:  # a folder under a file: not writable, even by root
        main(["--device", "cpu", "--quick", "--only", "chunked_loss", "--out", str(tmp_path / "a_file" / "out")])
    assert stop.value.code == 2 and "--out" in capsys.readouterr().err
    assert ran == []


@pytest.mark.timeout(120)
def test_a_test_step_whose_tests_were_all_skipped_is_not_a_pass(tmp_path, monkeypatch):
    """``cuda_tests`` on a machine where every test skips exits 0 in pytest; the suite reports the
    step as failed (``nothing_tested``), and one test that passes makes it a pass."""
    skipped, passing = tmp_path / "test_skipped.py", tmp_path / "test_passing.py"
    skipped.write_text("import pytest\n\ndef test_a():\n    pytest.skip('needs a CUDA device')\n")
    passing.write_text("def test_a():\n    assert True\n")
    out = tmp_path / "out"
    for path, expected in ((skipped, 1), (passing, 0)):
        step = Step("cuda_tests", None, ("-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)), 60, part=1)
        monkeypatch.setattr(gpu_suite, "STEPS", (step,))
        assert main(["--device", "cpu", "--quick", "--part", "1", "--out", str(out / path.stem)]) == expected
    status = [json.loads(line) for line in (out / "test_skipped" / STATUS).read_text().splitlines()]
    assert "every test was skipped" in status[-1]["nothing_tested"]


@pytest.mark.timeout(120)
def test_a_step_cut_at_its_limit_leaves_no_deepspeed_build_lock(tmp_path, monkeypatch):
    """A step killed while it builds a DeepSpeed op (a stand-in: it takes the op folder's lock, as
    torch's extension loader does, and sleeps past the limit) leaves the lock, on which every later
    DeepSpeed step would wait forever; the suite removes it after the kill and says so."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    folder = tmp_path / "ext" / "cpu_adam"  # torch's folder for CPU Adam under TORCH_EXTENSIONS_DIR
    building = ("-c", f"import os, time; os.makedirs({str(folder)!r}); open({str(folder / 'lock')!r}, 'w').close(); "
                      "print('locked', flush=True); time.sleep(60)")
    monkeypatch.setattr(gpu_suite, "STEPS", (Step("builds", None, building, 400, part=1),))
    out = tmp_path / "out"
    assert main(["--device", "cpu", "--quick", "--part", "1", "--out", str(out), "--budget_s", "8"]) == 1
    ended = [json.loads(line) for line in (out / STATUS).read_text().splitlines()][-1]
    assert ended["timed_out"] and "left by a build the time limit stopped" in ended["stderr_tail"]
    assert folder.is_dir() and not (folder / "lock").exists()


def test_a_step_cut_at_its_limit_leaves_no_process_behind(tmp_path, monkeypatch):
    """A step's process that started another in a session of its own (as torchrun starts its
    ranks) and then ended, so that init took the other over, is cut at the limit: the other is
    gone after the cut, found by the step's tag, not by its parent, and the suite goes on at once
    instead of waiting for it to close the step's output."""
    import time

    import psutil

    pid_file = tmp_path / "child.pid"
    starts = ("-c", "import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', 'import time; "
                    f"time.sleep(120)'], start_new_session=True); open({str(pid_file)!r}, 'w').write(str(child.pid))")
    monkeypatch.setattr(gpu_suite, "STEPS", (Step("starts", None, starts, 400, part=1),))
    out = tmp_path / "out"
    assert main(["--device", "cpu", "--quick", "--part", "1", "--out", str(out), "--budget_s", "6"]) == 1
    ended = [json.loads(line) for line in (out / STATUS).read_text().splitlines()][-1]
    child = int(pid_file.read_text())
    deadline = time.time() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
        time.sleep(0.1)
    alive = psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE
    if alive:
        psutil.Process(child).kill()
    assert not alive, "the step's child in a session of its own outlived the cut"
    assert ended["timed_out"] and ended["wall_s"] < 60, ended


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("gpu_suite")  # beside test_benchmarks' quick suite, never during it: its scratch check
def test_a_rehearsal_runs_the_real_gpu_steps_on_cpu_resumes_and_merges_only_elsewhere(tmp_path, monkeypatch):
    """``--rehearse --part 1`` (here its CUDA tests and OOM stress steps): the real scripts on this
    CPU at their smallest size under their GPU time limits, rows and status into ``--out``; the
    CUDA tests collected (the step fails if none is); a rerun into the same folder runs nothing
    again; ``--merge`` of the rehearsal is refused into benchmarks/results/ (exit 2, nothing
    written) and merges into another results folder once."""
    from conftest import fork_server_address
    from common import FORK_SERVER_VAR, RESULTS_DIR_VAR

    out = tmp_path / "out"
    cmd = [sys.executable, "benchmarks/gpu_suite.py", "--rehearse", "--part", "1", "--only", "cuda_tests,oom_stress",
           "--out", str(out)]
    env = {**__import__("os").environ, FORK_SERVER_VAR: fork_server_address()}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=560, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = {r["step"]: r for r in map(json.loads, proc.stdout.splitlines()) if "step" in r}
    assert steps["cuda_tests"]["returncode"] == 0 and "--collect-only" in steps["cuda_tests"]["command"]
    assert steps["oom_stress"]["returncode"] == 0 and steps["oom_stress"]["limit_s"] == 300  # its GPU limit
    rows = [json.loads(line) for line in (out / "oom_stress-cpu.jsonl").read_text().splitlines()]
    assert rows and all(r["commit"] for r in rows)
    status = [json.loads(line) for line in (out / STATUS).read_text().splitlines()]
    assert [s["step"] for s in status] == ["cuda_tests"] * 2 + ["oom_stress"] * 2 and all(s["rehearsal"] for s in status)
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120, env=env)
    assert again.returncode == 0 and (out / "oom_stress-cpu.jsonl").read_text().count("\n") == len(rows)
    assert all("skipped" in json.loads(line) for line in again.stdout.splitlines() if '"step"' in line)
    before = {p.name: p.stat().st_size for p in (REPO / "benchmarks" / "results").glob("*")}
    monkeypatch.setattr(gpu_suite, "RESULTS", REPO / "benchmarks" / "results")
    with pytest.raises(SystemExit) as refused:
        main(["--merge", str(out)])
    assert refused.value.code == 2
    assert {p.name: p.stat().st_size for p in (REPO / "benchmarks" / "results").glob("*")} == before
    elsewhere = tmp_path / "results"
    elsewhere.mkdir()
    merged = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--merge", str(out)], capture_output=True,
                            text=True, cwd=REPO, timeout=120, env={**env, RESULTS_DIR_VAR: str(elsewhere)})
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert json.loads(merged.stdout.splitlines()[0])["merged"]["oom_stress-cpu.jsonl"] == len(rows)


def _largest_model_step():
    step = next(s for s in gpu_suite.STEPS if s.name == "largest_model")
    args = list(step.cuda)
    value = lambda flag: args[args.index(flag) + 1]  # noqa: E731
    return step, value("--shapes").split(","), int(value("--steps")), int(value("--global_batch_size")), value


def test_largest_model_is_predicted_inside_its_limit_and_compares_with_stock_where_the_host_holds_it():
    """The GPU step's runs, predicted from the committed plan rows of its shapes on the claimed
    80 GB + 128 GiB machine at its global batch (each run: the start-up allowance and the plan's
    step time), end inside the step's limit with the budget given to the script below it; the
    stock ZeRO-3 offload config runs at the largest of the shapes its planned host peak fits (the
    comparison) and is refused, not started, at the larger ones."""
    import largest_model

    step, shapes, steps, batch, value = _largest_model_step()
    rows = largest_model.plan_rows(80, 128, batch)
    assert set(shapes) <= set(rows), f"plan rows missing: largest_model.py --plan --shapes {','.join(shapes)} " \
                                     f"--global_batch_size {batch} --results"
    predicted = largest_model.predicted_seconds(shapes, steps, 80, 128, batch)
    assert predicted <= float(value("--budget_s")) < step.limit_s, predicted
    size = {s: largest_model.planned(rows[s], "memtrain")["parameters"] for s in shapes}
    refused = {s: largest_model.refusal(largest_model.planned(rows[s], "stock_optimizer_offload"), 80, 128)
               for s in shapes}
    held = [s for s in shapes if refused[s] is None]
    assert held and all(size[h] < size[s] for h in held for s in shapes if refused[s]), refused
    assert refused["10b"] and "host" in refused["10b"]  # stock ZeRO-3's whole optimizer state: over 128 GiB
    assert all(largest_model.refusal(largest_model.planned(rows[s], "memtrain"), 80, 128) is None for s in shapes)
    assert shapes[0] == "10b"  # the flagship first: a later overrun cannot cost its row


def test_a_run_the_plan_refuses_or_the_budget_cannot_hold_is_a_row_not_a_start(monkeypatch):
    """largest_model's Budget: a placement the claimed machine cannot hold is refused with its
    numbers; a run predicted past the time left is not started; a run's measured start-up raises
    the next prediction."""
    import largest_model

    fits = {"name": "fsdp optimizer 80%→host", "chosen": True, "fits_device": True, "fits_host": True,
            "device_bytes": 77 * 2**30, "host_bytes": 114 * 2**30, "predicted_step_s": 5.0}
    stock = {**fits, "name": largest_model.STOCK_PLACEMENT, "chosen": False, "fits_host": False,
             "host_bytes": 212 * 2**30}
    budget = largest_model.Budget(100.0, {"10b": {"placements": [fits, stock]}})
    assert "212.0 GiB of host" in budget.why_not("10b", "stock_optimizer_offload", 8, 80, 128)
    assert budget.why_not("10b", "memtrain", 8, 80, 128) is None  # 40 + 8 x 5 = 80 s <= 100 s
    assert budget.why_not("tiny", "memtrain", 8, 80, 128) is None  # no plan row: no prediction, run
    budget.ran({"startup_s": 70.0})
    assert "predicted 110 s" in budget.why_not("10b", "memtrain", 8, 80, 128)
    assert largest_model.Budget(None, {"10b": {"placements": [fits]}}).why_not("10b", "memtrain", 800, 80, 128) is None
