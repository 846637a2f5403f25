"""Nobody waits for ever, in-process: the watchdog ends a rank stuck in a timed operation, a failed
collective or any other error becomes one message with its exit code, faults fire once per
output folder. The 2-rank runs under an elastic launcher are in test_checkpoint.py."""

import subprocess
import sys

import pytest

from conftest import REPO


def test_watchdog_ends_a_rank_stuck_in_a_timed_operation():
    script = ("import time; from memtrain.watchdog import Watchdog, progress\n"
              "progress('micro-batch 1 of 2, forward and backward', context='step 4')\n"
              "Watchdog(0.5, 3).start(); time.sleep(30)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 6
    assert "rank 3: no progress for" in proc.stderr and "step 4: micro-batch 1 of 2" in proc.stderr


def test_watchdog_leaves_untimed_and_progressing_operations_alone():
    script = ("import time; from memtrain.watchdog import Watchdog, progress\n"
              "w = Watchdog(1.5, 0).start()\n"
              "for i in range(8): progress(f'micro-batch {i}'); time.sleep(0.2)\n"
              "progress('checkpoint save', timed=False); time.sleep(2.5); w.stop(); print('done')")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr


def test_errors_become_one_message_and_their_exit_code():
    from memtrain.config import parse_args
    from memtrain.errors import CheckpointError
    from memtrain.train import error_report
    from memtrain.watchdog import progress

    cfg = parse_args(["--backend.timeout_s", "30"])
    progress("micro-batch 2 of 4, forward and backward", context="step 9")
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms "
                        "for recv operation to complete")
    code, message = error_report(gloo, cfg)
    assert code == 6 and "step 9: micro-batch 2 of 4" in message and "backend.timeout_s 30" in message
    assert error_report(CheckpointError("no space"), cfg) == (4, "checkpoint: no space")
    code, message = error_report(ValueError("bad shape"), cfg)
    assert code == 1 and "ValueError during step 9" in message and "--debug" in message
    debug = parse_args(["--debug"])
    assert debug.debug and "--debug" not in error_report(ValueError("bad shape"), debug)[1]


def test_an_unexpected_error_is_a_message_without_traceback_unless_debug(tmp_path, cache_dir):
    """A model factory that raises: exit 1 and one line; ``--debug`` shows the traceback."""
    from conftest import TRAIN, tiny_args

    args = tiny_args(tmp_path, cache_dir, "--training.max_steps", "1", "--model.factory", "toy_models:broken", "--model.config", "{}",
                     model=False)
    env = {"PYTHONPATH": str(REPO / "tests"), "PATH": "/usr/bin:/bin"}
    quiet = subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True, timeout=120, env=env)
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr
    assert "RuntimeError during start-up: toy_models.broken always fails" in quiet.stderr
    loud = subprocess.run([sys.executable, TRAIN, *args, "--debug"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert loud.returncode == 1 and "Traceback" in loud.stderr


def test_kills_fire_once_per_output_folder_and_only_on_their_ranks(tmp_path, monkeypatch):
    from memtrain import faults as faults_module
    from memtrain.config import parse_args

    fired = []
    monkeypatch.setattr(faults_module, "kill", fired.append)
    cfg = parse_args(["--faults.kill_at_step", "3", "--faults.kill_ranks", "[1]"]).faults
    for rank in (0, 1):
        injector = faults_module.FaultInjector(cfg, rank, str(tmp_path))
        injector.step = 3
        injector.after_step()
    assert fired == ["after step 3"]  # rank 1 only
    restarted = faults_module.FaultInjector(cfg, 1, str(tmp_path))
    restarted.step = 3
    restarted.after_step()
    assert fired == ["after step 3"]  # the marker: a restarted run continues past it
    assert sorted(p.name for p in (tmp_path / "faults_fired").iterdir()) == ["kill_at_step_3.rank1"]



def test_an_oom_that_escapes_the_agreement_makes_the_restart_start_smaller(tmp_path, cache_dir):
    """An out-of-memory error outside the OOM protocol (here in the optimizer update) ends the
    run (exit 3 from the command) after the rank noted it; the restarted run resumes from the
    last checkpoint one plan smaller instead of running out of memory again."""
    import torch

    from conftest import read_metrics, tiny_args
    from memtrain.train import error_report, main

    args = tiny_args(tmp_path, cache_dir, "--training.max_steps", "4", "--checkpoint.every_steps", "2",
                     "--faults.oom_in_optimizer_at_step", "3", "--memory.activation_checkpointing", "off")
    with pytest.raises(torch.OutOfMemoryError) as info:
        main(args)
    assert error_report(info.value, None)[0] == 3
    assert (tmp_path / "oom_escaped.rank0.json").exists()
    main(args)  # the restart: the fault fired already
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["micro_batch_size"] for r in records] == [2, 2, 1, 1]
    assert records[2]["event"].startswith("resume,oom_shrink")
    assert not (tmp_path / "oom_escaped.rank0.json").exists()
