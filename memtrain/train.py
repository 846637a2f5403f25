"""The script every launcher runs, and the ``memtrain`` console entry point.

    python memtrain/train.py --config recipes/code_lm_tiny.yaml [--section.key value ...]
    torchrun --nproc_per_node 2 memtrain/train.py --config ...
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 memtrain/train.py --config ...

Order of work: parse and validate the config (nothing is written before this passes), start
the process state (process group), then :func:`memtrain.build.build_trainer` (data on rank 0
first, model from the seed, plan, engine, model transforms), train, export.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memtrain.config import Config, ConfigError, parse_args  # noqa: E402
from memtrain.validation import validate  # noqa: E402


def prepare_config(argv: Optional[list[str]] = None) -> Config:
    """Parse and validate a command line against the launcher's world size (``WORLD_SIZE``).

    Raises:
        ConfigError: any invalid field (named in the message).
    """
    cfg = parse_args(argv)
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    return cfg


def main(argv: Optional[list[str]] = None):
    """Run training from a command line; returns the :class:`memtrain.loop.RunResult`.

    Raises:
        ConfigError: invalid configuration (before any process group or file is created).
    """
    cfg = prepare_config(argv)

    from contextlib import ExitStack

    import torch

    from memtrain.build import build_trainer
    from memtrain.distributed import ProcessState

    process = ProcessState(cpu=not torch.cuda.is_available())
    process.cap_cuda_memory(cfg.memory.cuda_memory_cap_gib)
    with ExitStack() as closing:
        closing.callback(process.close)  # last: the engine is closed first
        return build_trainer(cfg, process, closing).run()


INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT, the shell's convention)."""


def cli() -> None:
    """Console entry point (``memtrain export …`` goes to :mod:`memtrain.export`): exit 2 with
    the message on a config error, 3 when out of memory at the plan floor (the message holds the
    memory report), 4 when a checkpoint cannot be saved or resumed, 5 after too many consecutive
    non-finite steps, 130 after Ctrl-C (the first finishes the step and saves it, a second stops at
    once)."""
    if sys.argv[1:2] == ["export"]:  # memtrain export CKPT OUT
        from memtrain.export import main as export_main

        sys.exit(export_main(sys.argv[2:]))
    if sys.argv[1:2] in (["memory"], ["plan"]):  # memtrain plan|memory --config ...
        from memtrain.estimate import main as plan_main

        sys.exit(plan_main(sys.argv[2:], command=sys.argv[1]))
    from memtrain.errors import CheckpointError
    from memtrain.oom import OOMStop
    from memtrain.precision import NonFiniteStop

    exit_codes = {ConfigError: 2, OOMStop: 3, CheckpointError: 4, NonFiniteStop: 5}
    code = 0
    try:
        result = main()
        if result.summary.get("preempted") == "SIGINT":
            code = INTERRUPTED  # Ctrl-C: saved, then stopped
    except KeyboardInterrupt:  # Ctrl-C before the loop, or a second one: nothing more is written
        print("memtrain: interrupted; the last complete checkpoint is untouched (rerun the same command to resume "
              "from it)", file=sys.stderr)
        code = INTERRUPTED
    except tuple(exit_codes) as exc:
        prefix = "checkpoint: " if isinstance(exc, CheckpointError) else ""
        print(f"memtrain: {prefix}{exc}", file=sys.stderr)
        code = next(code for kind, code in exit_codes.items() if isinstance(exc, kind))
    _exit_now(code)


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
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say
            pass
    os._exit(code)

if __name__ == "__main__":
    cli()
