"""A torchrun stand-in for the test suite: one process imports torch, transformers, accelerate,
DeepSpeed and memtrain once, then forks the ranks of every run.

A torchrun launch spends ~4 of a tiny run's ~7 s starting Python and importing the same
libraries in the agent and in every rank; forking from a process that has imported them (and run
nothing) skips that, the way ``multiprocessing``'s ``forkserver`` start method does. Each rank gets
the environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_*``) and runs the script as ``__main__``; like
torchrun's agent, the server looks at the ranks every 0.1 s and stops the others (SIGTERM, then
SIGKILL after 30 s) once one has exited non-zero, and the client reports torchrun's exit status
(1 when a rank failed) and its failure summary (``exitcode  : N`` per rank that did not exit 0,
the stopped ones' ``-15`` included).

What a fork cannot stand in for stays on the real launchers: elastic restarts, two agents as two
nodes, ``accelerate launch`` / ``deepspeed``, signals sent to the launcher, and the launcher's own
output — those tests pass ``launcher=`` to :func:`conftest.launch`.

Run as ``python tests/forkserver.py ADDRESS`` (the client, :class:`ForkServer`, starts it); each
client connection is served by a forked session, one request (a dict) and two answers (the ranks'
pids, then their exit codes) per run, pickled over :class:`multiprocessing.connection.Connection`.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from typing import Optional

WARM_MODULES = [
    "torch", "accelerate", "deepspeed", "transformers", "jsonargparse",
    "transformers.modeling_utils", "transformers.modeling_layers", "transformers.masking_utils",
    "transformers.activations", "transformers.models.auto.modeling_auto", "transformers.models.gpt2.modeling_gpt2",
    "deepspeed.runtime.zero.muon.muon_optimizer", "torch.distributed.checkpoint", "torch.distributed.fsdp",
]
"""Modules a run imports (at start or lazily; ``python -X importtime`` of DDP, FSDP2 and ZeRO-3
runs), imported once by the server, with every ``memtrain`` module."""

MONITOR_INTERVAL_S = 0.1
"""How often the ranks are looked at (torchrun's ``--monitor-interval`` default)."""

STOP_GRACE_S = 30.0
"""Seconds between SIGTERM and SIGKILL when the other ranks are stopped (torchrun's default)."""


def _torchrun_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """The variables torchrun (one node, no restarts) sets for the worker of ``rank``."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def _exit_code(exc: SystemExit) -> int:
    """The process exit status Python gives ``sys.exit(exc.code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _rank_main(req: dict, rank: int) -> None:
    """The forked rank: torchrun's environment, output to the request's files, ``script`` as ``__main__``."""
    import atexit
    import runpy
    import threading
    import traceback

    code = 1
    try:
        os.setsid()  # a session of its own, as torchrun starts its workers: signals reach its children too
        for fd, name in ((1, "stdout"), (2, "stderr")):
            f = os.open(f"{req[name]}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.environ.clear()
        os.environ.update(req["env"])
        if req["torchrun"]:
            os.environ.update(_torchrun_env(rank, req["nproc"], req["port"]))
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # torchrun's default, the user's value kept
        os.chdir(req["cwd"])
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(req["script"]), *extra, *sys.path[1:]]
        sys.argv = [req["script"], *req["args"]]
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            runpy.run_path(req["script"], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:  # what the interpreter prints for an uncaught exception
            traceback.print_exc()
            code = 1
        threading._shutdown()  # as at interpreter exit: wait for non-daemon threads, then atexit
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait_ranks(pids: dict[int, int], monitor_interval_s: float = MONITOR_INTERVAL_S) -> dict[int, int]:
    """Wait for every rank as torchrun's agent does: look every ``monitor_interval_s`` (torchrun's
    ``--monitor-interval``); once a rank has failed, SIGTERM the rest (SIGKILL after
    :data:`STOP_GRACE_S`).

    Returns rank → exit code (negative: the signal that ended it).
    """
    results: dict[int, int] = {}
    stopping_since = None
    while len(results) < len(pids):
        time.sleep(monitor_interval_s)
        while len(results) < len(pids):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in pids:
                results[pids[pid]] = os.waitstatus_to_exitcode(status)
        running = [p for p, r in pids.items() if r not in results]
        if stopping_since is None and any(results.values()):
            stopping_since = time.monotonic()
            _signal(running, signal.SIGTERM)
        elif stopping_since is not None and time.monotonic() - stopping_since > STOP_GRACE_S:
            _signal(running, signal.SIGKILL)
    return results


def _serve_session(conn) -> None:
    """Answer one client's run requests until it closes the connection (a forked child of the server)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # this process waits for its ranks itself
    while True:
        try:
            req = conn.recv()
        except EOFError:
            return
        store = _start_agent_store(req["port"]) if req["torchrun"] else None
        pids = {}
        for rank in range(req["nproc"]):
            pid = os.fork()
            if pid == 0:
                conn.close()
                _rank_main(req, rank)
            pids[pid] = rank
        conn.send(sorted(pids))
        results = _wait_ranks(pids, req.get("monitor_interval_s") or MONITOR_INTERVAL_S)
        if store is not None:
            _signal([store])
            try:
                os.waitpid(store, 0)
            except ChildProcessError:  # reaped with the ranks
                pass
        conn.send(results)


def _start_agent_store(port: int) -> int:
    """Fork the process that holds the run's TCP store at ``port``, as torchrun's agent does (its
    workers connect to it: ``TORCHELASTIC_USE_AGENT_STORE=True``; the store outlives any rank).
    Its own process: a store's server thread must not be in a process that forks later."""
    pid = os.fork()
    if pid == 0:
        try:
            import torch.distributed as dist

            store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
            while store is not None:
                time.sleep(3600)
        finally:
            os._exit(0)
    return pid


def _answer_cpu_info_once() -> None:
    """Ask py-cpuinfo once here, through memtrain's per-process cache of its answer
    (:func:`memtrain.distributed.cache_cpu_info`), so every forked run inherits the answer: each
    question starts a Python subprocess (~1.1 s), which the suite's runs asked ~40 times (every
    ``memtrain plan`` measures DeepSpeed's CPU Adam, whose constructor asks; so does each
    ZeRO-offload run). The CPU is the same for every run of the session."""
    from memtrain.distributed import cache_cpu_info

    cache_cpu_info()
    try:
        import cpuinfo
    except ImportError:  # no DeepSpeed: nothing asks
        return
    cpuinfo.get_cpu_info()


def _build_transformers_caches() -> None:
    """Build transformers' table of checkpoint weight renamings (a module-level cache of ~1,100
    compiled patterns, 0.18 s) here, once: every run's export (``save_pretrained``) and every
    ``from_pretrained`` reads it, and each forked run would otherwise build its own."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        get_checkpoint_conversion_mapping("gpt2")
    except Exception:  # noqa: BLE001 - another transformers version: each run builds what it needs
        pass


def serve(address: str) -> None:
    """Import the libraries every run needs, then serve each client that connects to ``address``
    (a Unix socket) from a forked session, until the process that started the server exits.

    The imported objects are frozen out of the garbage collector before any fork (``gc.freeze``,
    as Python's documentation advises for a process that forks without exec): otherwise a run's
    first full collection writes to every inherited object's header, and the kernel copies each
    page it touches — 36,000 page faults and 0.3 s per rank, measured, which made a tiny 8-step
    DDP run take 0.85 s instead of 0.57 s."""
    import gc
    import importlib
    import pkgutil
    import select
    import socket
    from multiprocessing.connection import Connection

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # what memtrain sets on a machine without CUDA
    import memtrain

    for name in WARM_MODULES + [m.name for m in pkgutil.walk_packages(memtrain.__path__, "memtrain.")]:
        importlib.import_module(name)
    _answer_cpu_info_once()
    _build_transformers_caches()
    gc.collect()
    gc.freeze()  # the imported objects out of the children's collections (below)
    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # finished sessions are reaped by the kernel
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(address)
        listener.listen()
        print("ready", flush=True)
        while os.getppid() == parent:
            if not select.select([listener], [], [], 1.0)[0]:
                continue
            client, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                code = 0
                try:
                    _serve_session(Connection(client.detach()))
                except BaseException:  # into server.log: the client sees only a closed connection
                    import traceback

                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)
            client.close()
    shutil.rmtree(os.path.dirname(address), ignore_errors=True)


class ForkServer:
    """The client. Connects to the server at ``address`` or, without one, starts a server on first
    use (its environment: this process's plus ``env``; it exits when this process does). One run at
    a time per client; a process started by this one reaches the same server through
    :attr:`address` (``benchmarks/common.py`` reads it from ``MEMTRAIN_TEST_FORKSERVER``)."""

    def __init__(self, env: dict[str, str] | None = None, address: str | None = None):
        self._env = env or {}
        self._conn = None
        self._address = address

    @property
    def address(self) -> str:
        """The server's socket (the server is started if it is not running yet)."""
        if self._address is None:
            self._start()
        return self._address

    def _start(self) -> None:
        import subprocess
        import tempfile

        folder = tempfile.mkdtemp(prefix="memtrain-forkserver-")
        address = os.path.join(folder, "socket")
        log = os.path.join(folder, "server.log")  # its imports' notices (the runs' own output is the ranks')
        with open(log, "wb") as fh:
            server = subprocess.Popen([sys.executable, os.path.abspath(__file__), address],
                                      env={**os.environ, **self._env}, stdout=subprocess.PIPE, stderr=fh)
        if server.stdout.readline().strip() != b"ready":
            with open(log, errors="replace") as fh:
                raise RuntimeError(f"the fork server did not start (exit {server.wait()}):\n{fh.read()[-4000:]}")
        self._address = address

    def run(self, cmd: list[str], script: str, args: list[str], *, nproc: int, port: int, env: dict[str, str],
            cwd: str, timeout: float, torchrun: bool = True, monitor_interval_s: Optional[float] = None):
        """Run ``script args`` on ``nproc`` forked ranks with torchrun's environment (``torchrun``
        false: one process as ``python script args`` runs it; ``monitor_interval_s``: torchrun's
        ``--monitor-interval``, default :data:`MONITOR_INTERVAL_S`); a
        :class:`subprocess.CompletedProcess` whose ``returncode`` is torchrun's (0, or 1 when a rank
        failed; the process's own without torchrun; ``None`` when the run outlived ``timeout`` s and
        was killed), stdout/stderr the ranks' in rank order, and torchrun's failure summary appended
        to stderr."""
        import subprocess
        from multiprocessing.connection import Connection

        if self._conn is None:
            import socket

            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.address)
            self._conn = Connection(sock.detach())
        base = os.path.join(os.path.dirname(self.address), f"run{os.getpid()}-{port}")
        self._conn.send({"script": script, "args": list(args), "nproc": nproc, "port": port, "env": dict(env),
                         "cwd": cwd, "stdout": base + ".out", "stderr": base + ".err", "torchrun": torchrun,
                         "monitor_interval_s": monitor_interval_s})
        pids: list[int] = []
        try:
            pids = self._conn.recv()
            timed_out = not self._conn.poll(timeout)
            if timed_out:
                _signal(pids)
            results = self._conn.recv()
        except BaseException:  # interrupted (pytest-timeout, Ctrl-C) or the session died: no run outlives
            _signal(pids)      # the test, and the next run gets a new session, not this run's late answer
            self._conn.close()
            self._conn = None
            raise
        out, err = (_read_all(f"{base}.{kind}", nproc) for kind in ("out", "err"))
        if not torchrun:
            return subprocess.CompletedProcess(cmd, None if timed_out else results[0], out, err)
        err += "".join(f"[{rank}]:\n  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code}\n"
                       for rank, code in sorted(results.items()) if code != 0)
        returncode = None if timed_out else (1 if any(results.values()) else 0)
        return subprocess.CompletedProcess(cmd, returncode, out, err)


def _signal(pids: list[int], signum: int = signal.SIGKILL) -> None:
    """Send ``signum`` to each process's group (a rank leads its own; the store's is the session's
    own group, so the store alone gets it)."""
    for pid in pids:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _read_all(base: str, nproc: int) -> str:
    """The ranks' output files (``base.0``, ``base.1``, …) joined in rank order, then removed."""
    parts = []
    for rank in range(nproc):
        path = f"{base}.{rank}"
        with open(path, errors="replace") as fh:
            parts.append(fh.read())
        os.remove(path)
    return "".join(parts)


if __name__ == "__main__":
    serve(sys.argv[1])
