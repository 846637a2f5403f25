"""Reading a recipe file and naming a mistyped key: the checks :func:`memtrain.config.parse_args`
runs besides jsonargparse's — a recipe that is not valid YAML or gives a key twice, and the key a
user probably meant (names from HF Trainer, Accelerate and DeepSpeed first, then by spelling).
"""

from __future__ import annotations

from typing import Optional

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
