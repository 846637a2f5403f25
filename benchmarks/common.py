"""What the benchmarks share: launching memtrain runs, reading their metrics, writing results.

Every benchmark prints one JSON object per configuration to stdout, appends the same to
``benchmarks/results/<name>-<device>.jsonl`` with ``--results``, and draws a PNG with ``--plot``
(matplotlib, a dependency of memtrain).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "memtrain" / "train.py")
RESULTS_DIR_VAR = "MEMTRAIN_RESULTS_DIR"
"""Environment variable: the folder result rows are appended to instead of benchmarks/results/ (the
GPU suite's ``--out``: on a remote GPU machine only that folder comes back)."""
RESULTS = Path(os.environ.get(RESULTS_DIR_VAR) or REPO / "benchmarks" / "results")

ENGINES = {
    "ddp": ["--backend.name", "ddp"],
    "fsdp": ["--backend.name", "fsdp"],
    "zero2": ["--backend.name", "deepspeed", "--backend.zero_stage", "2"],
    "zero3": ["--backend.name", "deepspeed", "--backend.zero_stage", "3"],
}

# CPU size: a ~0.4M-parameter GPT-2 on a 1 MB slice of the standard library (fp32)
CPU_ARGS = [
    "--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), "--precision", "fp32",
    "--data.max_bytes", "1000000", "--data.vocab_size", "1024", "--data.seq_len", "64",
    "--model.config.n_layer", "4", "--model.config.n_embd", "64", "--model.config.n_head", "4",
    "--model.config.n_positions", "64", "--training.warmup_steps", "2", "--training.eval_every", "0",
    "--training.eval_samples", "8", "--checkpoint.every_steps", "0",
]
# the test suite's tiny run (tests/conftest.py: 2 layers, 32 wide, 32 tokens), global batch 8 of micro-batches of 2
TINY_ARGS = [
    "--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), "--precision", "fp32",
    "--data.max_bytes", "300000", "--data.vocab_size", "512", "--data.seq_len", "32",
    "--training.global_batch_size", "8", "--training.micro_batch_size", "2", "--training.warmup_steps", "2",
    "--training.eval_every", "0", "--training.eval_samples", "8", "--model.config.n_layer", "2",
    "--model.config.n_embd", "32", "--model.config.n_head", "2", "--model.config.n_positions", "32",
]
GPU_ARGS = ["--config", str(REPO / "recipes" / "code_lm_350m.yaml"), "--training.eval_every", "0",
            "--training.eval_samples", "16", "--checkpoint.every_steps", "0"]


def device_name(device: str) -> str:
    """``cpu`` or the CUDA device's name, for result file names (``nvidia-h100-80gb-hbm3``)."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0).lower().replace(" ", "-")
    return "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FORK_SERVER_VAR = "MEMTRAIN_TEST_FORKSERVER"
"""Set by the test suite (the socket of ``tests/forkserver.py``): the ``--quick`` plumbing runs
its ranks as forks of a process that has imported torch and memtrain once, instead of torchrun.
Unset (every measurement), :func:`run_memtrain` launches torchrun."""


@functools.lru_cache(maxsize=None)
def fork_server():
    """The client of the tests' fork server (only when :data:`FORK_SERVER_VAR` is set)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from forkserver import ForkServer

    return ForkServer(address=os.environ[FORK_SERVER_VAR])


class RunFailed(RuntimeError):
    """A memtrain run exited non-zero (``returncode`` and the tail of stderr attached)."""

    def __init__(self, returncode: int, stderr: str):
        self.returncode, self.stderr = returncode, stderr
        super().__init__(f"run failed ({returncode}): {stderr[-2000:]}")


def run_memtrain(args: list[str], output_dir: str, nproc: int, timeout: float = 1800,
                 env: Optional[dict] = None, script: str = TRAIN, metrics: bool = True,
                 rlimit_data: Optional[int] = None) -> list[dict]:
    """Run ``memtrain/train.py`` (or a benchmark's ``script``) with ``nproc`` ranks (torchrun; gloo
    on CPU) and return its ``metrics.jsonl`` records (``metrics`` False: a script that writes none; []).
    ``rlimit_data``: bytes of ``RLIMIT_DATA`` for the launcher and every rank (``prlimit --data``;
    a real per-process memory limit), None = none.

    Raises:
        RunFailed: non-zero exit (e.g. 3 = out of memory at micro-batch 1).
        subprocess.TimeoutExpired: the run took longer than ``timeout`` seconds.
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(port), script, *args, "--output_dir", output_dir]
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    _run(cmd, [*args, "--output_dir", output_dir], full_env, timeout, nproc=nproc, port=port, script=script,
         rlimit_data=rlimit_data)
    return read_metrics(output_dir) if metrics else []


def run_cli(args: list[str], timeout: float = 1800, ok_codes: tuple[int, ...] = (0,)) -> str:
    """Run ``memtrain ARGS`` in one process (``plan``, ``memory``, …) and return its stdout.

    Args:
        ok_codes: exit codes that are answers, not failures (``plan``'s 3: nothing fits).

    Raises:
        RunFailed: an exit code not in ``ok_codes`` (the tail of stderr attached).
        subprocess.TimeoutExpired: it took longer than ``timeout`` seconds.
    """
    return _run([sys.executable, TRAIN, *args], args, dict(os.environ), timeout, ok_codes=ok_codes).stdout


def _run(cmd: list[str], train_args: list[str], env: dict, timeout: float, nproc: Optional[int] = None,
         port: int = 0, script: str = TRAIN, ok_codes: tuple[int, ...] = (0,),
         rlimit_data: Optional[int] = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (``script`` with ``train_args``: under torchrun with ``nproc`` ranks,
    or alone) from the repository root; with :data:`FORK_SERVER_VAR` set, the same run forked by
    the tests' server (torchrun's environment when ``nproc`` is given).

    Raises:
        RunFailed: an exit code not in ``ok_codes``.
        subprocess.TimeoutExpired: it took longer than ``timeout`` seconds.
    """
    if rlimit_data is not None:  # a process of its own, started under the limit (not forked by a server above it)
        proc = _run_limited(cmd, env, timeout, rlimit_data)
    elif os.environ.get(FORK_SERVER_VAR):
        proc = fork_server().run(cmd, script, train_args, nproc=nproc or 1, port=port, env=env, cwd=str(REPO),
                                 timeout=timeout, torchrun=nproc is not None)
        if proc.returncode is None:
            raise subprocess.TimeoutExpired(cmd, timeout, proc.stdout, proc.stderr)
    else:
        proc = run_killable(cmd, env, timeout, terminate_s=30)  # torchrun's ranks go with it at the limit
    if proc.returncode not in ok_codes:
        raise RunFailed(proc.returncode, proc.stderr)
    return proc


KILL_TAG_VAR = "MEMTRAIN_KILL_TAG"
"""Set in the environment of a command :func:`run_killable` starts (every process it starts
inherits it), so :func:`kill_tree` finds them all, whoever their parent is by then."""


def kill_tree(pid: int, tag: Optional[str] = None) -> list[int]:
    """SIGKILL process ``pid``, its process group, every descendant (psutil, found before the
    kill) and, with ``tag``, every process whose environment carries ``KILL_TAG_VAR=tag``: those
    that started sessions of their own (torchrun's ranks) and those whose parent exited and init
    took over go too, instead of living on and holding memory, a GPU or the caller's pipe for what
    runs next. Returns the pids signalled (gone already: skipped)."""
    import signal

    import psutil

    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(pid)
        found = {pid: root, **{p.pid: p for p in root.children(recursive=True)}}
    except psutil.Error:
        pass
    if tag is not None:
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(KILL_TAG_VAR) == tag:
                    found[proc.pid] = proc
            except psutil.Error:  # gone, a zombie, or another user's
                continue
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    killed = []
    for proc in found.values():
        try:
            proc.kill()
            killed.append(proc.pid)
        except psutil.Error:
            pass
    return killed


def run_killable(cmd: list[str], env: dict, timeout: float, terminate_s: float = 0.0,
                 preexec_fn=None) -> subprocess.CompletedProcess:
    """``cmd`` from the repository root in a session of its own, its environment tagged
    (:data:`KILL_TAG_VAR`). Past ``timeout`` seconds: SIGTERM and up to ``terminate_s`` seconds
    to end (torchrun then ends its ranks), then :func:`kill_tree` of everything it started, and
    ``subprocess.TimeoutExpired`` (with what it printed) is raised; the pipes are read for at most
    30 s more, so a process that escaped cannot keep the caller waiting. Ctrl-C in the caller
    kills it the same way (its session does not hear the terminal)."""
    import uuid

    tag = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**env, KILL_TAG_VAR: tag}, start_new_session=True, preexec_fn=preexec_fn)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        pass
    except KeyboardInterrupt:  # its own session does not hear the terminal's Ctrl-C: it goes with the caller
        kill_tree(proc.pid, tag)
        raise
    if terminate_s > 0:
        proc.terminate()
        try:
            proc.wait(timeout=terminate_s)
        except subprocess.TimeoutExpired:
            pass
    kill_tree(proc.pid, tag)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = "", ""
    raise subprocess.TimeoutExpired(cmd, timeout, out, err)


def _run_limited(cmd: list[str], env: dict, timeout: float, rlimit_data: int) -> subprocess.CompletedProcess:
    """``cmd`` under ``RLIMIT_DATA`` = ``rlimit_data`` bytes (:func:`run_killable`: past
    ``timeout`` seconds the launcher is sent SIGTERM, so torchrun ends its ranks, then everything
    it started is killed and ``subprocess.TimeoutExpired`` is raised)."""
    import resource

    limit = (rlimit_data, rlimit_data)
    return run_killable(cmd, env, timeout, terminate_s=60,
                        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, limit))


def read_metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def step_times(records: list[dict]) -> list[float]:
    """Seconds per optimizer step, from the ``elapsed_s`` of consecutive records."""
    return [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:])]


def tokens_per_s(records: list[dict]) -> float:
    """Median tokens/s over ``records`` (per-step values, robust to one slow step)."""
    return statistics.median(r["tokens_per_s"] for r in records) if records else float("nan")


def scratch_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=f"memtrain-bench-{prefix}-")


@functools.lru_cache(maxsize=1)
def provenance() -> dict:
    """The code a result measured, as every emitted row records it: ``commit`` (this checkout's git
    HEAD, 40 hex digits) and ``worktree_clean`` (no uncommitted change under memtrain/ or
    benchmarks/, the results aside); both None outside a git checkout."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)

    try:
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--", "memtrain", "benchmarks", ":(exclude)benchmarks/results")
    except (OSError, subprocess.TimeoutExpired):  # no git
        return {"commit": None, "worktree_clean": None}
    if head.returncode != 0 or status.returncode != 0:  # not a checkout
        return {"commit": None, "worktree_clean": None}
    return {"commit": head.stdout.strip(), "worktree_clean": not status.stdout.strip()}


def spread(values: list[float]) -> dict:
    """``{"min", "median", "max"}`` of ``values`` (a benchmark's repeats); raises ValueError when empty."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def emit(name: str, device: str, result: dict, save: bool) -> None:
    """Print one result as a JSON line, with the code it measured (:func:`provenance`); with
    ``save`` also append it to benchmarks/results/ (or :data:`RESULTS_DIR_VAR`'s folder), on disk
    before this returns: a run cut short keeps every row it printed."""
    line = json.dumps({**result, **provenance()})
    print(line, flush=True)
    if save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        with open(RESULTS / f"{name}-{device_name(device)}.jsonl", "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def bar_chart(path: str, title: str, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    """A grouped bar chart (PNG).

    Raises:
        SystemExit: matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 3, 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
