"""``memtrain train ... --print_config``: what a run of this command line will do, printed without
starting anything — the recipe and the overrides, the launcher's settings as applied, the
resolved engine, precision and plan (micro-batch, accumulation, levers), the tokens per step and
the outputs, then the whole resolved config. jsonargparse's own ``--print_config`` printed only
the parsed config, before the launcher's settings and the engine were resolved.
"""

from __future__ import annotations

import os
from typing import Optional

import yaml

from memtrain.config import parse_args, to_dict
from memtrain.distributed import prepare_libraries
from memtrain.launcher import apply_accelerate_settings
from memtrain.levers import lever_choices
from memtrain.planning.run_placement import configured_spec
from memtrain.precision import resolve_precision
from memtrain.validation import validate


def describe_run(argv: list[str], environ: Optional[dict] = None) -> dict:
    """What ``memtrain train argv`` will run on this launcher (``WORLD_SIZE`` of ``environ``).

    Returns:
        A YAML-serialisable dict: ``recipe``, ``overrides``, ``launcher`` (world size, the
        Accelerate settings' notes), ``engine`` (the resolved engine spec), ``precision``,
        ``plan`` (``global_batch_size``, ``micro_batch_size`` and ``gradient_accumulation_steps``
        per rank — or who chooses them — and each lever's setting or choices), ``tokens_per_step``,
        ``max_steps``, ``output_dir`` and ``config`` (every key, resolved).

    Raises:
        memtrain.errors.ConfigError: the command line is invalid (as a run would say).
    """
    import torch

    prepare_libraries(torch.cuda.is_available())  # before transformers imports torchao: no library noise

    environ = os.environ if environ is None else environ
    world_size = int(environ.get("WORLD_SIZE", "1"))
    cfg = parse_args(argv)
    notes = apply_accelerate_settings(cfg, world_size, environ)
    validate(cfg, world_size)
    spec = configured_spec(cfg, world_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = cfg.training
    share = t.global_batch_size // world_size
    if t.micro_batch_size == "auto":
        micro: object = "auto: the planner chooses before step 1 (memtrain plan shows its table)"
        accumulation: object = "global_batch_size / (micro_batch_size × world_size)"
    else:
        micro, accumulation = t.micro_batch_size, share // t.micro_batch_size
    recipe = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    return {
        "recipe": recipe,
        "overrides": [a for i, a in enumerate(argv) if a != "--config" and (i == 0 or argv[i - 1] != "--config")],
        "launcher": {"world_size": world_size, "device": device, "accelerate_notes": notes},
        "engine": spec.as_dict(),
        "precision": resolve_precision(cfg.precision, device),
        "plan": {"global_batch_size": t.global_batch_size, "per_rank_batch": share, "micro_batch_size": micro,
                 "gradient_accumulation_steps": accumulation,
                 "levers": {name: {"chosen by the planner from": list(choices)} if len(choices) > 1 else choices[0]
                            for name, choices in lever_choices(cfg, spec).items()}},
        "tokens_per_step": t.global_batch_size * cfg.data.seq_len,
        "max_steps": t.max_steps,
        "output_dir": cfg.output_dir,
        "config": to_dict(cfg),
    }


def format_run(described: dict) -> str:
    """:func:`describe_run`'s dict as YAML, with a first line saying nothing was started."""
    return "# what this command will run (nothing was started)\n" + yaml.safe_dump(
        described, sort_keys=False, default_flow_style=False, allow_unicode=True)
