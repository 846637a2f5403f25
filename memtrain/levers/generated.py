"""What the levers' declarations are written into: :class:`memtrain.config.MemoryConfig`'s lever
fields (each lever's :class:`memtrain.levers.base.ConfigField`, and ``memory.levers``, whose help
names what the planner may choose), the resume table's row of settings that restart the plan
(docs/checkpoints.md) and the README's row of levers turned on by hand.

The config is written as source, not built from :data:`memtrain.levers.LEVERS` when imported, so
that it imports no torch (``memtrain --help`` stays instant) and nothing the levers import.
``python -m memtrain.levers`` rewrites the three from a source checkout; the tests fail while any
of them differs from what the levers declare (``tests/test_levers.py``).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any, Callable

import memtrain.levers as levers  # its LEVERS as registered when called (the tests register stand-ins)
from memtrain.checkpoint.compat import ResumeRules
from memtrain.levers.base import ConfigField, choices_annotation

WIDTH = 100
"""Longest line of a generated field or docstring (the marker lines aside)."""
BEGIN = "    # generated from the levers' declarations (memtrain/levers/): python -m memtrain.levers rewrites them"
END = "    # end of the levers' fields"
LEVERS_DOC = ("auto = the planner (training.micro_batch_size auto) and out-of-memory recovery also choose among the "
              "lossless levers left at their defaults: {levers}; off = only the micro-batch and activation "
              "checkpointing off/on, as configured.")
"""``memory.levers``' help; ``{levers}``: each lever's :attr:`memtrain.levers.base.Lever.auto_words`."""
RESUME_RULE = ("the plan restarts at the new value; when unchanged, the checkpoint's plan (where OOM recovery or "
               "grow-back may have moved it) carries on")
"""The rule cell of docs/checkpoints.md's row of settings whose change restarts the plan."""
BY_HAND = "| turn memory levers on by hand |"
"""The first cell of the README's row of levers turned on by hand."""


def config_fields() -> tuple[ConfigField, ...]:
    """Every ``memory`` field the levers declare, ``memory.levers`` first."""
    words = [x.auto_words for x in levers.LEVERS if x.auto_words]
    listed = ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else "".join(words)
    return (ConfigField("levers", choices_annotation(("off", "auto")), "off", LEVERS_DOC.format(levers=listed)),
            *(f for x in levers.LEVERS for f in x.config_fields))


def _literal(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def config_source() -> str:
    """The lines of :class:`memtrain.config.MemoryConfig` between :data:`BEGIN` and :data:`END`
    (both included): each field with its docstring, as written by hand elsewhere in the config."""
    lines = [BEGIN]
    for f in config_fields():
        if '"""' in f.doc or f.doc.endswith('"'):
            raise ValueError(f"memory.{f.name}: a help text that ends a docstring early (its quotes)")
        lines.append(f"    {f.name}: {f.annotation} = {_literal(f.default)}")
        lines += textwrap.wrap(f'"""{f.doc}"""', WIDTH, initial_indent="    ", subsequent_indent="    ",
                               break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines + [END]) + "\n"


def resume_row() -> str:
    """docs/checkpoints.md's row of the settings whose change on resume restarts the plan
    (:class:`memtrain.checkpoint.compat.ResumeRules` with the levers' rules)."""
    keys = [key for key, rule in ResumeRules.with_levers(levers.resume_rules()).takes_effect.items()
            if rule.startswith("the plan restarts")]
    return f"| {', '.join(f'`{k}`' for k in keys)} | {RESUME_RULE} |\n"


def by_hand_row() -> str:
    """The README's row of the levers a user turns on by hand (:attr:`memtrain.levers.base.Lever.by_hand`)."""
    flags = ", ".join(f"`--{x.config_key} {x.by_hand}`".replace("|", "\\|") for x in levers.LEVERS if x.by_hand)
    return f"{BY_HAND} {flags}, … | [memory](docs/memory.md#memory-and-numerics-levers) |\n"


def _config(text: str) -> str:
    head, _, rest = text.partition(BEGIN + "\n")
    _, _, tail = rest.partition(END + "\n")
    if not rest or not tail:
        raise ValueError(f"memtrain/config.py: the lines between '{BEGIN.strip()}' and '{END.strip()}' are missing")
    return head + config_source() + tail


def _row(starts: Callable[[str], bool], row: str) -> Callable[[str], str]:
    def rewrite(text: str) -> str:
        lines = text.splitlines(keepends=True)
        found = [i for i, line in enumerate(lines) if starts(line)]
        if len(found) != 1:
            raise ValueError(f"expected one row to rewrite, found {len(found)}")
        lines[found[0]] = row
        return "".join(lines)
    return rewrite


def rewrites() -> dict[str, Callable[[str], str]]:
    """``{path relative to the repository: its text → its text with the levers' lines rewritten}``.

    Raises (when called on a file):
        ValueError: the file has lost the lines to rewrite (its markers or its row).
    """
    return {"memtrain/config.py": _config,
            "docs/checkpoints.md": _row(lambda line: line.rstrip().endswith(f"| {RESUME_RULE} |"), resume_row()),
            "README.md": _row(lambda line: line.startswith(BY_HAND), by_hand_row())}


def stale(root: Path) -> list[str]:
    """The files under ``root`` (a source checkout) whose levers' lines differ from the levers'
    declarations."""
    return [rel for rel, rewrite in rewrites().items() if (root / rel).is_file()
            and rewrite((root / rel).read_text()) != (root / rel).read_text()]
