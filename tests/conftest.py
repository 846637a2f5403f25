"""Shared fixtures: a small cached corpus, a tiny model recipe, and a 2-rank gloo launcher."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/toy_models.py, tests/forkserver.py
from forkserver import ForkServer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "memtrain" / "train.py")

# A ~50k-parameter GPT-2 on a 300 kB slice of the standard library: enough to show every
# property, small enough for 2 CPU cores.
TINY_MODEL_ARGS = [
    "--model.config.n_layer", "2", "--model.config.n_embd", "32", "--model.config.n_head", "2",
    "--model.config.n_positions", "32",
]
TINY_BASE_ARGS = [
    "--config", str(REPO / "recipes" / "code_lm_tiny.yaml"),
    "--precision", "fp32",
    "--data.max_bytes", "300000", "--data.vocab_size", "512", "--data.seq_len", "32",
    "--training.global_batch_size", "8", "--training.micro_batch_size", "2",
    "--training.warmup_steps", "2", "--training.eval_every", "0", "--training.eval_samples", "8",
    "--checkpoint.every_steps", "0",  # tests that need checkpoints turn them on
]
TINY_ARGS = TINY_BASE_ARGS + TINY_MODEL_ARGS

STEPS = 8
"""Steps of the shared reference runs (and of most 2-rank tests): past the warmup (2 steps) into
the cosine decay, so a wrong schedule or a skipped sample shows."""

ENGINES = {
    "ddp": ["--backend.name", "ddp"],
    "ddp_reducer": ["--backend.name", "ddp", "--memory.oom_recovery", "false"],  # DDP's own bucket reducer
    "fsdp": ["--backend.name", "fsdp"],
    "fsdp_keep_gathered": ["--backend.name", "fsdp", "--backend.reshard_after_forward", "false"],
    "zero1": ["--backend.name", "deepspeed", "--backend.zero_stage", "1"],
    "zero2": ["--backend.name", "deepspeed", "--backend.zero_stage", "2"],  # memtrain's schedule, no offload
    "zero3": ["--backend.name", "deepspeed", "--backend.zero_stage", "3"],
    # ZeRO-2 as a transformers-docs DeepSpeed JSON: CPU optimizer offload, AdamW and WarmupDecayLR with "auto"
    "zero2_offload_hf": ["--backend.name", "deepspeed", "--backend.deepspeed_config",
                         str(REPO / "ds_configs" / "zero2_offload_hf.json")],
    # a DeepSpeed JSON with CPU optimizer offload, half of the optimizer state kept on the device
    # (partial offload: the device half stepped by torch's AdamW, the host half by CPU Adam)
    # memtrain's optimizer offload, half of it on the host, its CPU step overlapped (a CPU device's default: not)
    "fsdp_offload_optimizer": ["--backend.name", "fsdp", "--backend.offload", "optimizer",
                               "--backend.offload_optimizer_ratio", "0.5", "--backend.host_step_overlap", "true"],
    "zero3_partial_offload": ["--backend.deepspeed_config", str(REPO / "ds_configs" / "zero3_offload.json"),
                              "--backend.offload_optimizer_ratio", "0.5"],
}
"""Every engine setting the tests run, by name: the command-line arguments that choose it."""


def shared_dir(tmp_path_factory) -> Path:
    """This session's temporary root, which every pytest-xdist worker of the session sees (a
    worker's own ``basetemp`` is ``<root>/popen-gwN``; without xdist, the ``basetemp``)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if base.name.startswith("popen-gw") else base


@contextlib.contextmanager
def made_once(path: Path):
    """``with made_once(path) as make:`` -- ``make`` is True in the one process of the session
    (of its xdist workers) that must make the folder ``path``, which is empty then; the others wait
    (an exclusive ``flock`` on ``path.lock``) and get False once it is made. A maker that raises
    leaves it unmade: the next one starts again from an empty folder."""
    import fcntl
    import shutil

    done = path.with_name(path.name + ".done")
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            yield False
            return
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        yield True
        done.touch()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One corpus cache for the whole session, its xdist workers included (tokenizer trained once)."""
    path = shared_dir(tmp_path_factory) / "cache"
    with made_once(path) as make:
        if make:
            from memtrain.config import parse_args
            from memtrain.data import build_corpus

            build_corpus(parse_args(TINY_ARGS + ["--data.cache_dir", str(path)]).data)
    return str(path)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, cache_dir):
    """``reference(engine, steps=STEPS, nproc=2, extra=())``: the output folder of the tiny run of
    ``ENGINES[engine]`` with those arguments, run once per session (by whichever test of whichever
    xdist worker asks first; the others wait for it). Tests compare their runs' losses, data and
    schedule with it; they must not write into it."""
    import hashlib

    def run(engine: str, steps: int = STEPS, nproc: int = 2, extra: tuple = ()) -> Path:
        digest = hashlib.sha1(json.dumps([engine, steps, nproc, list(extra)]).encode()).hexdigest()[:10]
        out = shared_dir(tmp_path_factory) / f"reference_{engine}_{steps}_{nproc}_{digest}"
        with made_once(out) as make:
            if make:
                launch(tiny_args(out, cache_dir, "--training.max_steps", str(steps), *ENGINES[engine], *extra),
                       nproc=nproc)
        return out

    return run


def tiny_args(output_dir, cache_dir, *extra: str, model: bool = True) -> list[str]:
    """Command-line arguments of the tiny test run (``model=False``: without the GPT-2 size keys)."""
    return (TINY_ARGS if model else TINY_BASE_ARGS) + ["--output_dir", str(output_dir), "--data.cache_dir", str(cache_dir), *extra]


def read_metrics(output_dir) -> list[dict]:
    """The records of ``output_dir/metrics.jsonl``."""
    with open(Path(output_dir) / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


RUN_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
"""Set for every launched run (and for the fork server, whose libraries read them at import)."""

_FORK_SERVER = ForkServer(env=RUN_ENV)

_BUILD_OPS = """
from deepspeed.ops.op_builder import CPUAdamBuilder
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
ShareMemCommBuilder().load()
CPUAdamBuilder().load()
"""


def _build_deepspeed_ops(niceness: int) -> subprocess.Popen:
    """Build DeepSpeed's JIT-compiled ops the suite loads — the shared-memory collectives (every
    DeepSpeed run on CPU) and CPU Adam (the offload runs), ~120 s of CPU on a machine that has
    not built them — in a process started with the session, beside the first tests instead of
    stalling the first test that needs each op. torch's extension loader locks an op's build
    folder, so that test waits for this build rather than starting its own; on a machine that
    has them this only loads them. ``niceness``: 19 in one process (the build takes what the
    tests leave idle); 0 under xdist, whose two workers leave nothing idle (at 19 the build would
    starve while DeepSpeed tests wait for it)."""
    return subprocess.Popen([sys.executable, "-c", _BUILD_OPS], env={**os.environ, **RUN_ENV, "OMP_NUM_THREADS": "2"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: os.nice(niceness))


def pytest_configure(config):
    """In an xdist worker, torch computes on one thread (as every rank does, :data:`RUN_ENV`): two
    workers with two threads each on 2 cores would spin for each other's cores."""
    if hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Under xdist, the tests marked ``heavy`` (half a minute or more alone) before the other
    ungrouped tests (xdist hands out the ``xdist_group`` groups first, largest first): the
    workers of ``-n 2`` start the long ones early and finish together, instead of one worker
    running a long test alone at the end. In one process the order stays the files' (a module
    fixture would otherwise be set up twice)."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops(request):
    """The background build of :func:`_build_deepspeed_ops`, waited for at the end of the session
    (stopped mid-build it would leave its lock behind, and later loads would wait on it). Not
    started for the CUDA tests alone (``-m cuda``: the GPU suite's ``cuda_tests`` step), which load
    no DeepSpeed op: a step cut at its time limit then leaves no build behind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    # one build per session (the first worker's), none for the CUDA tests alone
    if worker not in (None, "gw0") or request.config.getoption("markexpr", "") == "cuda":
        yield None
        return
    proc = _build_deepspeed_ops(19 if worker is None else 0)
    yield proc
    proc.wait()


def _run_env(env: dict | None) -> dict[str, str]:
    """A run's environment: this process's, :data:`RUN_ENV`, ``tests/`` on ``PYTHONPATH`` (the
    model factories of ``toy_models.py``), then ``env``."""
    pythonpath = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, **RUN_ENV, "PYTHONPATH": pythonpath, **(env or {})}


def fork_server_address() -> str:
    """The fork server's socket, for a process this one starts (see ``benchmarks/common.py``)."""
    return _FORK_SERVER.address


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "{port}"]
"""The real launcher, for tests of what a user sees (its output, what a run imports): ``launch(…, launcher=TORCHRUN)``."""


def launch(args: list[str], nproc: int = 2, timeout: float = 300, env: dict | None = None,
           launcher: list[str] | None = None, check: bool = True, script: str = TRAIN,
           cwd=REPO, monitor_interval_s: float | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` (``memtrain/train.py``, or a script using :class:`memtrain.Trainer`) with
    ``nproc`` CPU ranks (gloo) in ``cwd``: forked by :mod:`forkserver` with torchrun's environment
    (``monitor_interval_s``: torchrun's ``--monitor-interval``; its default when None), or under
    ``launcher`` (the command before the script, ``{port}`` filled in) when given.

    Fails the test (instead of hanging CI) when the run does not finish within ``timeout`` s,
    and, with ``check``, when it exits non-zero.
    """
    port = _free_port()
    full_env = _run_env(env)
    if launcher is None:
        cmd = ["forkserver", "--nproc_per_node", str(nproc), script, *args]
        proc = _FORK_SERVER.run(cmd, script, args, nproc=nproc, port=port, env=full_env, cwd=str(cwd), timeout=timeout,
                                monitor_interval_s=monitor_interval_s)
    else:
        cmd = [*[a.replace("{port}", str(port)) for a in launcher], script, *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
        except subprocess.TimeoutExpired as exc:
            proc = subprocess.CompletedProcess(cmd, None, exc.stdout, exc.stderr)
    if proc.returncode is None:
        pytest.fail(f"distributed run timed out after {timeout}s: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    if check and proc.returncode != 0:
        pytest.fail(f"run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_cli(args: list[str], script: str = TRAIN, cwd=REPO, env: dict | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """``python script args`` (default: the ``memtrain`` command, ``memtrain/train.py``) as one
    process forked by :mod:`forkserver` — no launcher's variables, its own exit code — in ``cwd``
    with this environment plus ``env``. Fails the test when it runs past ``timeout`` s."""
    full_env = _run_env(env)
    cmd = ["python", str(script), *args]
    proc = _FORK_SERVER.run(cmd, str(script), [str(a) for a in args], nproc=1, port=0, env=full_env, cwd=str(cwd),
                            timeout=timeout, torchrun=False)
    if proc.returncode is None:
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc


def child_exit_codes(proc: subprocess.CompletedProcess) -> set[int]:
    """The exit codes torchrun reports for its failed ranks (``exitcode  : 3`` in its failure
    summary; torchrun itself exits 1 whatever they were)."""
    import re

    return {int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
