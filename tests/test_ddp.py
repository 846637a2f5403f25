"""Two CPU ranks (gloo) under DDP train exactly like one rank with the same global batch."""

import os
import subprocess
import sys

import pytest

from conftest import REPO, STEPS, TORCHRUN, TRAIN, launch, read_metrics, tiny_args

pytestmark = pytest.mark.slow
RUN = ["--training.max_steps", str(STEPS)]


@pytest.fixture(scope="module")
def single_rank(reference):
    return read_metrics(reference("ddp", nproc=1))


def _assert_same_run(records, reference, rel=1e-5):
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r, ref in zip(records, reference):
        assert r["batch_fingerprint"] == ref["batch_fingerprint"]
        assert r["lr"] == ref["lr"] and r["samples_seen"] == ref["samples_seen"]
        assert r["loss"] == pytest.approx(ref["loss"], rel=rel)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_two_ranks_torchrun_match_one_rank(tmp_path, cache_dir, single_rank):
    launch(tiny_args(tmp_path, cache_dir, *RUN), launcher=TORCHRUN)
    records = read_metrics(tmp_path)
    assert records[0]["micro_batch_size"] == 2 and records[0]["gradient_accumulation_steps"] == 2
    _assert_same_run(records, single_rank)
    assert single_rank[0]["gradient_accumulation_steps"] == 4


def test_two_ranks_accelerate_launch_match_one_rank(tmp_path, cache_dir, single_rank):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           TRAIN, *tiny_args(tmp_path, cache_dir, *RUN, "--training.micro_batch_size", "4")]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = read_metrics(tmp_path)
    assert records[0]["micro_batch_size"] == 4 and records[0]["gradient_accumulation_steps"] == 1
    _assert_same_run(records, single_rank)
