"""Reading a recipe file and naming a mistyped key: the checks :func:`memtrain.config.parse_args`
runs besides jsonargparse's — a recipe that is not valid YAML or gives a key twice, and the key a
user probably meant (names from HF Trainer, Accelerate and DeepSpeed first, then by spelling) —
and jsonargparse's own errors put in words (:func:`explain_parse_error`).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Literal, Optional, Union

import yaml

from memtrain.errors import ConfigError


def yaml_problem(files: list[str]) -> Optional[str]:
    """The first of ``files`` that is not valid YAML, with the parser's line and column; or None."""
    for path in files:
        try:
            with open(path) as fh:
                yaml.safe_load(fh)
        except (OSError, yaml.YAMLError) as exc:
            return f"{path} is not valid YAML: {exc}"
    return None


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice (first at line {seen[key] + 1}, again at line "
                    f"{key_node.start_mark.line + 1}); YAML would keep only the last, dropping the first's settings. "
                    "Merge them into one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def check_recipe(path: str) -> None:
    """Refuse a recipe that is not valid YAML or gives a key (or section) twice.

    Raises:
        ConfigError: field ``config``; the message names the file, the key and both lines.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            yaml.load(fh, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.constructor.ConstructorError as exc:
        raise ConfigError("config", f"{path}: {exc.problem}") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {exc}") from None


ALIASES = {
    "learning_rate": "training.lr", "lr": "training.lr", "per_device_train_batch_size": "training.micro_batch_size",
    "train_batch_size": "training.global_batch_size", "batch_size": "training.global_batch_size",
    "train_micro_batch_size_per_gpu": "training.micro_batch_size", "micro_batch_size": "training.micro_batch_size",
    "gradient_accumulation_steps": "training.micro_batch_size; memtrain derives the accumulation as "
                                   "global_batch_size / (micro_batch_size × world_size)",
    "max_steps": "training.max_steps", "num_train_epochs": "training.max_steps", "steps": "training.max_steps",
    "bf16": "precision; --precision bf16", "fp16": "precision; --precision fp16", "mixed_precision": "precision",
    "warmup": "training.warmup_steps", "warmup_ratio": "training.warmup_steps", "seed": "training.seed",
    "max_grad_norm": "training.max_grad_norm", "gradient_clipping": "training.max_grad_norm",
    "weight_decay": "training.weight_decay", "adam_epsilon": "training.adam_eps", "eval_steps": "training.eval_every",
    "save_steps": "checkpoint.every_steps", "save_total_limit": "checkpoint.keep_last",
    "logging_steps": "training.log_every", "report_to": "logging.log_with", "gradient_checkpointing":
    "memory.activation_checkpointing", "resume_from_checkpoint": "resume", "block_size": "data.seq_len",
    "max_seq_length": "data.seq_len", "model_name_or_path": "model.pretrained", "zero_stage": "backend.zero_stage",
    "deepspeed": "backend.deepspeed_config", "distributed_type": "backend.name",
}
"""Names users bring from HF Trainer, Accelerate and DeepSpeed (the last part of a mistyped key)
→ memtrain's key, suggested before any match by spelling."""


def closest_key(parser, key: str) -> str:
    """`` (did you mean 'training.max_steps'?)`` for a mistyped key, or '': a known alias from HF
    Trainer, Accelerate or DeepSpeed first (:data:`ALIASES`), then by spelling."""
    import difflib

    known = [o.lstrip("-") for a in parser._actions for o in a.option_strings if o.startswith("--")]
    alias, _, note = ALIASES.get(key.rsplit(".", 1)[-1], "").partition("; ")
    if alias in known and alias != key:
        return f" (did you mean '{alias}'?{' ' + note if note else ''})"
    close = [k for k in known if k.startswith(key)] or difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def explain_parse_error(parser, config_cls, args: list[str], msg: str) -> tuple[str, str]:
    """``(the field, the message)`` for jsonargparse's error ``msg`` on command line ``args``: an
    unknown key (on the command line or in a recipe) with the key probably meant; a value of the
    wrong type or outside the choices in words (``'fp8' is not one of auto, bf16, fp16, fp32``,
    from ``config_cls``'s type hints); a recipe that is not valid YAML named with its line."""
    key = "config"
    if 'Parser key "' in msg and dataclasses.is_dataclass(_field_type(config_cls, msg.split('Parser key "', 1)[1].split('"', 1)[0])):
        key = msg.split('Parser key "', 1)[1].split('"', 1)[0]  # a section given a value, not its keys
        msg = not_a_section(config_cls, key)
    elif 'Parser key "' in msg:
        key = msg.split('Parser key "', 1)[1].split('"', 1)[0]
        got = re.search(r"Given value: (.*?)\s*$", msg) or re.search(r"Got value: (.*?)\s*$", msg)
        expected = _expected(_field_type(config_cls, key))
        if got and expected:
            msg = f"'{got[1]}' is not {expected}"
    elif (group := re.search(r"Group '([\w.]+)' does not accept option '([\w.]+)'", msg)):  # a recipe's key
        key = f"{group[1]}.{group[2]}"
        msg = f"unknown key '{key}' in the recipe{closest_key(parser, key)}"
    elif (option := re.search(r"Option '([\w.]+)' is not accepted", msg)):  # a recipe's key outside any section
        key = option[1]
        msg = f"unknown key '{key}' in the recipe{closest_key(parser, key) or _closest_section(config_cls, key)}"
    elif "unrecognized arguments:" in msg:
        key = msg.split("unrecognized arguments:", 1)[1].split()[0].lstrip("-").split("=", 1)[0]
        msg = f"unknown key '{key}'{closest_key(parser, key)}. " + msg
    elif "Problems parsing config" in msg:  # name the YAML file, not "<unicode string>"
        msg = yaml_problem([args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]) or msg
    return key, msg.replace("\n", " ")


def not_a_section(config_cls, key: str) -> str:
    """The words for section ``key`` (``backend``, ``data.speech``) given a value instead of a
    mapping of its keys."""
    first = dataclasses.fields(_field_type(config_cls, key))[0].name
    parts = key.split(".")
    python = "".join(f"{{'{p}': " for p in parts) + f"{{'{first}': ...}}" + "}" * len(parts)
    return (f"is a section of settings, not a value: give a mapping of its keys (in a recipe '{parts[-1]}:' with "
            f"its keys indented below it, in Python {python}, on the command line --{key}.{first} ...)")


def _closest_section(config_cls, key: str) -> str:
    """`` (did you mean 'training'?)`` for a mistyped section at the start of ``key``, or ''."""
    import difflib

    head = key.split(".", 1)[0]
    sections = [f.name for f in dataclasses.fields(config_cls)]
    close = difflib.get_close_matches(head, sections, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}{key[len(head):]}'?)" if close else ""


def _field_type(cls, dotted: str):
    """The type hint of field ``dotted`` (``training.max_steps``) of dataclass ``cls``; None if unknown."""
    head, _, rest = dotted.partition(".")
    hint = typing.get_type_hints(cls).get(head) if dataclasses.is_dataclass(cls) else None
    return _field_type(hint, rest) if rest and hint is not None else hint


def _expected(hint) -> str:
    """What a field of type ``hint`` takes, in words ('' for a type not described here)."""
    members = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    words = [_one(m) for m in members if m is not type(None)]
    if not all(words):
        return ""
    return " or ".join(words) + (" (or null)" if type(None) in members else "")


def _one(hint) -> str:
    """One member of a field's type in words ('' when not described here)."""
    if typing.get_origin(hint) is Literal:
        choices = [str(c) for c in typing.get_args(hint)]
        return f"one of {', '.join(choices)}" if len(choices) > 1 else choices[0]
    if typing.get_origin(hint) is list:
        return "a list such as [0, 1]"
    return {int: "an integer", float: "a number", bool: "true or false"}.get(hint, "")
