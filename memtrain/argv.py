"""The command line's words before jsonargparse reads them (:func:`memtrain.config.parse_args`):
the launchers' own arguments taken out, ``--model.config.KEY VALUE`` overrides gathered into a
dict, a bare ``--debug`` given its value, negative numbers joined to their option."""

from __future__ import annotations

from typing import Any

import yaml

from memtrain.errors import ConfigError


def strip_launcher_args(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Remove launcher arguments (``--local_rank``, ``--local-rank``, ``--deepspeed``) and
    ``--model.config.KEY VALUE`` overrides that jsonargparse cannot put into a free dict."""
    rest: list[str] = []
    extra: dict[str, Any] = {"model_config": {}}
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, val = arg.partition("=")
        takes_value = not eq
        if key == "--debug" and takes_value and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            rest += ["--debug", "true"]  # a bare flag, as users type it
        elif key in ("--local_rank", "--local-rank", "--deepspeed") or key.startswith("--model.config."):
            if takes_value:
                if i + 1 >= len(argv):
                    raise ConfigError(key.lstrip("-"), "expects a value")
                val = argv[i + 1]
                i += 1
            if key.startswith("--model.config."):
                extra["model_config"][key[len("--model.config."):]] = yaml.safe_load(val)
            else:
                extra[key.lstrip("-").replace("-", "_")] = val
        else:
            rest.append(arg)
        i += 1
    return rest, extra


def join_negative_numbers(argv: list[str]) -> list[str]:
    """``--key -3e-3`` → ``--key=-3e-3``: argparse reads a value starting with ``-`` as an option
    unless it looks like a plain negative integer or decimal."""
    out, i = [], 0
    while i < len(argv):
        if argv[i].startswith("--") and "=" not in argv[i] and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            try:
                float(argv[i + 1])
            except ValueError:
                pass
            else:
                out.append(f"{argv[i]}={argv[i + 1]}")
                i += 2
                continue
        out.append(argv[i])
        i += 1
    return out
