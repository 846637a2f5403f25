"""The script every launcher runs, and the ``memtrain`` console entry point.

    python memtrain/train.py --config recipes/code_lm_tiny.yaml [--section.key value ...]
    torchrun --nproc_per_node 2 memtrain/train.py --config ...
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 memtrain/train.py --config ...

The command line is a user of :class:`memtrain.api.Trainer` (which owns the order of work:
parse and validate the config, nothing written before this passes; the host allocator's
thresholds; the process state; :func:`memtrain.build.build_trainer`; train; export); this module
adds the subcommands and turns errors into exit codes.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import sys
import traceback
from typing import Optional

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memtrain.config import Config, ConfigError  # noqa: E402
from memtrain.errors import CheckpointError, NonFiniteStop, OOMStop, OutputError  # noqa: E402
from memtrain.watchdog import (COLLECTIVE_FAILED, collective_failure_message, is_collective_failure,  # noqa: E402
                               operation)


def main(argv: Optional[list[str]] = None):
    """Run training from a command line; returns the :class:`memtrain.loop.RunResult`.

    Raises:
        ConfigError: invalid configuration (before any process group or file is created).
    """
    return _trainer(sys.argv[1:] if argv is None else argv).fit()


def _trainer(argv: list[str]):
    """A :class:`memtrain.api.Trainer` for the command line ``argv`` (the class a Python script uses)."""
    from memtrain.api import Trainer  # heavy (torch and the engines): not imported for --help or a subcommand

    return Trainer(args=argv, owns_process=True)


USAGE = """usage: memtrain [train] --config RECIPE.yaml [--section.key value ...]
       memtrain {plan,memory,export,plot} ...

subcommands (each has its own --help):
  train    train a model (the default): every config key as --section.key value
  plan     the micro-batch plans and placements for a config, for this or another machine (no training)
  memory   the same report as one JSON object
  export   a checkpoint's weights as a transformers folder (model.safetensors, config, tokenizer)
  plot     draw a run's metrics.jsonl (loss, learning rate, throughput, memory, plan changes)

memtrain train ... --print_config prints what the command will run (engine, plan, levers, config)
and exits without starting anything.

exit codes: 0 done, 2 bad input, 3 out of memory at the smallest plan, 4 checkpoint or export, 5 non-finite
steps, 6 collective failure or timeout, 130 Ctrl-C, 1 memtrain's own error (docs/operations.md, "Exit codes")."""


INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT, the shell's convention)."""
SUBCOMMANDS = {"plan": "memtrain.estimate", "memory": "memtrain.estimate", "export": "memtrain.export",
               "plot": "memtrain.plot"}
"""Each subcommand's module: its ``main(argv, command)`` runs it and returns the exit code."""
COMMANDS = ("train", *SUBCOMMANDS)


def run_subcommand(command: str, argv: list[str]) -> int:
    """Run ``memtrain COMMAND argv`` (:data:`SUBCOMMANDS`); its exit code. The module is imported
    here, when it runs (each imports torch: ``memtrain --help`` stays instant)."""
    return importlib.import_module(SUBCOMMANDS[command]).main(argv, command=command)


def cli() -> None:
    """Console entry point (``memtrain export|plot|plan|memory …`` go to their modules,
    :data:`SUBCOMMANDS`): exit 2 with
    the message on a config error, 3 when out of memory at the plan floor (the message holds the
    memory report), 4 when a checkpoint cannot be saved or resumed or the model cannot be exported
    (a full disk: the path and its free bytes named), 5 after too many consecutive
    non-finite steps, 6 when a collective failed or timed out or the watchdog ended a rank that
    stopped making progress (``backend.timeout_s``), 130 after Ctrl-C (the first finishes the step
    and saves it, a second stops at once), 1 on any other error. Every error is one message on
    stderr; ``--debug`` adds the Python traceback. ``memtrain --help`` lists the subcommands;
    ``memtrain train`` is the trainer (also without the word); ``--print_config`` prints what it
    would run and exits (:func:`print_run`)."""
    if sys.argv[1:2] in (["--help"], ["-h"], ["help"]) or sys.argv[1:] == []:
        print(USAGE)
        sys.exit(0)
    first = sys.argv[1]
    if not first.startswith("-") and first not in COMMANDS:  # a mistyped subcommand, not a config key
        close = difflib.get_close_matches(first, COMMANDS, n=1)
        print(f"memtrain: unknown command '{first}'{f' (did you mean {close[0]!r}?)' if close else ''}; the commands "
              f"are {', '.join(COMMANDS)} (memtrain --help)", file=sys.stderr)
        sys.exit(2)
    if first == "train":  # memtrain train --config ... is memtrain --config ...
        del sys.argv[1]
    if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:  # memtrain export CKPT OUT, memtrain plan --config ...
        sys.exit(run_subcommand(sys.argv[1], sys.argv[2:]))
    if any(a == "--print_config" or a.startswith("--print_config=") for a in sys.argv[1:]):
        sys.exit(print_run([a for a in sys.argv[1:] if not a.startswith("--print_config")]))
    cfg = None
    try:
        trainer = _trainer(sys.argv[1:])
        cfg = trainer.config
        result = trainer.fit()
        code = INTERRUPTED if result.summary.get("preempted") == "SIGINT" else 0  # Ctrl-C: saved, then stopped
    except KeyboardInterrupt:  # Ctrl-C before the loop, or a second one: nothing more is written
        print("memtrain: interrupted; the last complete checkpoint is untouched (rerun the same command to resume "
              "from it)", file=sys.stderr)
        code = INTERRUPTED
    except Exception as exc:  # noqa: BLE001 — every error becomes one message and its exit code
        code, message = error_report(exc, cfg)
        if cfg is not None and cfg.debug:
            traceback.print_exc()
        if not _said_by_rank_0(exc):
            print(f"memtrain: {message}", file=sys.stderr)
    _exit_now(code)


def _said_by_rank_0(exc: Exception) -> bool:
    """Whether ``exc`` is a stop every rank raises together (out of memory at the smallest plan,
    a non-finite loss), said once by rank 0, and this is another rank."""
    return isinstance(exc, (OOMStop, NonFiniteStop)) and int(os.environ.get("RANK", "0")) != 0


def print_run(argv: list[str]) -> int:
    """``--print_config``: print what this command line will run (:mod:`memtrain.show`) and
    return 0, or the error's exit code and message (2 for a bad input) without running."""
    from memtrain.show import describe_run, format_run  # heavy (torch, the model): only for --print_config

    try:
        print(format_run(describe_run(argv)))
        return 0
    except Exception as exc:  # noqa: BLE001 — the same message and exit code a run would give
        code, message = error_report(exc, None)
        print(f"memtrain: {message}", file=sys.stderr)
        return code


def error_report(exc: Exception, cfg: Optional[Config]) -> tuple[int, str]:
    """The exit code and one-line message of an error that ended a run (see :func:`cli`)."""
    from memtrain.oom import escaped_oom_path, is_host_oom, is_oom  # heavy (torch): loaded only by a failed run

    for kind, code, prefix in ((ConfigError, 2, ""), (OOMStop, 3, ""), (OutputError, 4, ""),
                               (CheckpointError, 4, "checkpoint: "), (NonFiniteStop, 5, "")):
        if isinstance(exc, kind):
            return code, f"{prefix}{exc}"
    rank = int(os.environ.get("RANK", "0"))
    if is_oom(exc):
        noted = cfg is not None and os.path.exists(escaped_oom_path(cfg.output_dir, rank))
        return 3, (f"rank {rank}: {'host' if is_host_oom(exc) else 'device'} memory ran out outside the OOM protocol, "
                   f"during {operation()}: "
                   f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'torch.OutOfMemoryError'}"
                   + ("; noted in output_dir, so a restarted run (torchrun --max-restarts, or rerunning the command) "
                      "starts one plan smaller" if noted else ""))
    if is_collective_failure(exc):
        return COLLECTIVE_FAILED, collective_failure_message(exc, rank, cfg.backend.timeout_s if cfg else 600.0)
    hint = "" if cfg is not None and cfg.debug else " (rerun with --debug for the traceback)"
    return 1, f"rank {rank}: {type(exc).__name__} during {operation()}: {exc}{hint}"


def _exit_now(code: int) -> None:
    """Exit with ``code`` once everything of the run is on disk, skipping the interpreter's
    finalisation (its atexit hooks that matter here, logging's flush, are run first).

    Why: the run is over (checkpoints committed, async writes joined, the process group
    destroyed), but finalisation can still abort the process, rarely, with "terminate called
    without an active exception" (exit -6 under torchrun, seen about once in 250 two-rank CPU
    runs with gloo and DeepSpeed). A C++ communicator thread that still frees a tensor holding a
    Python reference needs the GIL after the interpreter has begun shutting down; CPython ends
    such a thread with pthread_exit, whose unwinding through a noexcept frame calls
    std::terminate (pytorch/pytorch PR 179291 and issue 190489 describe the same crash). An
    abort there would turn a finished run, or a clean exit code 3/4/5, into a failed job.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say
            pass
    os._exit(code)

if __name__ == "__main__":
    cli()
