"""``memtrain train --help``: one line per option, taken from the config's own field docstrings
(the text under each field in :mod:`memtrain.config`: its first sentence, whole), with
jsonargparse's type and default after it; the test-only ``faults.*`` options are left out unless
``--help_all`` is given, except ``faults.memory_budget_mib``, which the docs recommend."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import typing

HIDDEN_SECTIONS = ("faults",)
"""Config sections shown only by ``--help_all`` (fault injection for tests and benchmarks)..."""
SHOWN_ANYWAY = ("faults.memory_budget_mib",)
"""... but for these keys, which the docs recommend to users (a simulated device to try a plan on)."""


def field_docs(cls, prefix: str = "") -> dict[str, str]:
    """``{"section.key": docstring}`` for every field of dataclass ``cls`` and its nested
    dataclasses (a docstring is the string literal right under the field, as in :mod:`memtrain.config`)."""
    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, after in zip(body, body[1:] + [None]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[prefix + node.target.id] = after.value.value
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            docs.update(field_docs(hints[f.name], f"{prefix}{f.name}."))
    return docs


def one_line(doc: str) -> str:
    """The first sentence of ``doc``, whole, on one line (reST markup dropped; the help
    formatter wraps it)."""
    text = re.sub(r"\s+", " ", doc.replace("``", "")).strip()
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def describe(parser, config_cls, show_all: bool) -> None:
    """Give each option of ``parser`` (built from ``config_cls``) its field's one-line docstring;
    hide the :data:`HIDDEN_SECTIONS` unless ``show_all``."""
    docs = field_docs(config_cls)
    for group in parser._action_groups:  # "<class 'memtrain.config.DataConfig'>" → "data"
        dests = [a.dest for a in group._group_actions]
        if group.title and group.title.startswith("<class ") and dests:
            section = len(dests) > 1 and dests[1].startswith(dests[0] + ".")  # the section's own option first
            group.title = dests[0] if section else "run" if all("." not in d for d in dests) \
                else dests[0].rsplit(".", 1)[0]
    sections = {d.rsplit(".", 1)[0] for d in docs if "." in d}
    for action in parser._actions:
        dest = getattr(action, "dest", "")
        if dest == "print_config":  # memtrain's own (memtrain/show.py), not jsonargparse's
            action.help = "print what this command line would run (engine, plan, levers, config) as YAML and exit"
        if dest in sections:  # jsonargparse's per-section "Path to a configuration file."
            action.help = f"a YAML file holding the {dest} section's keys"
        if not show_all and dest.split(".")[0] in HIDDEN_SECTIONS and dest not in SHOWN_ANYWAY:
            action.help = argparse.SUPPRESS
        elif dest in docs:
            action.help = one_line(docs[dest])  # jsonargparse's formatter expands no % here
