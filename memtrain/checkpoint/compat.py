"""Whether a checkpoint can be resumed by this run, and what a changed setting does on resume.

Every config key is in one of two classes (a :class:`ResumeRules`' ``must_match`` and
``takes_effect``; a test checks that every key of :class:`memtrain.config.Config` is in exactly
one), never silently ignored:

* **must match** — refused by name with both values (exit 2). The data position in a
  checkpoint is a cursor ``(epoch, step)`` into a permutation of the training samples
  (:mod:`memtrain.data.sampler`); it means the same samples only if the samples, their order and
  the step size are the same: the data (files and their contents, tokenizer, ``seq_len``,
  encoding), ``training.seed`` and ``training.global_batch_size``. The engine and where its state
  lives, the optimizer state's dtype, and the weights the run started from, must match too
  (except the engine switches of docs/checkpoints.md, and ``checkpoint.format``, read as one).
* **takes effect** — from the first resumed step, said in the log and in the ``resume`` event
  of ``metrics.jsonl`` (``changed``: key → ``[checkpoint's, this run's]``). The learning-rate
  schedule is a function of the optimizer step and ``training.lr``, ``warmup_steps``,
  ``min_lr_ratio`` and ``max_steps``: the resumed run evaluates this run's function at the
  restored step. Optimizer settings are written into the restored optimizer. A changed
  ``training.micro_batch_size`` or runtime lever setting (each lever's ``on_resume``,
  :class:`memtrain.levers.base.Lever`) restarts the plan there; unchanged, the checkpoint's plan
  (where OOM recovery may have moved it) carries on.

The levers' own rules come in from the caller (:func:`memtrain.levers.resume_rules`, folded in by
:meth:`ResumeRules.with_levers`), so this module knows no lever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from memtrain.config import ConfigError

DATA_POSITION_KEYS = ("training.global_batch_size", "training.seed", "data.seq_len", "data.kind")
"""Settings the meaning of a saved data position depends on."""
DATA_KEYS = ("data.files", "data.max_bytes", "data.vocab_size", "data.text_field", "data.validation_fraction",
             "data.speech")
"""Settings that choose the data: compared when the corpus identity of either side is not known
(the identity, a hash of the files' names and contents and these settings, is the finer test)."""


MUST_MATCH = DATA_POSITION_KEYS + DATA_KEYS + (
    "data.encoding", "model.pretrained", "model.factory", "backend.name", "backend.zero_stage", "backend.offload",
    "backend.nvme_path")
"""Settings a resumed run must keep besides the levers' (compared by :meth:`ResumeRules.check`;
the engine and model shapes also by :class:`memtrain.checkpoint.stateful.EngineState` against
the manifest)."""
OLDER_DEFAULTS = {"optimizer.state_dtype": "fp32"}
"""Must-match keys that checkpoints of earlier versions lack, with the value those versions used."""
ENGINE_KEYS = ("backend.name", "backend.zero_stage")
"""Must match, compared as resolved (``auto`` becomes an engine) against the manifest's ``backend`` and
``zero_stage`` by :class:`memtrain.checkpoint.stateful.EngineState`."""
PLACEMENT_KEYS = ("backend.offload", "backend.offload_optimizer_ratio", "backend.nvme_path")
"""Must match, unless this run says ``backend.offload: auto``: then the checkpoint's placement is
taken (:mod:`memtrain.planning.placement`), whatever its config recorded."""

TAKES_EFFECT = {
    "memory.allow_lossy_levers": "the checkpoint's optimizer state dtype is kept (memtrain/planning/resumed.py)",
    "training.max_steps": "the cosine decay is recomputed to end at the new max_steps",
    "training.lr": "the schedule is this run's, at the resumed step",
    "training.min_lr_ratio": "the schedule is this run's, at the resumed step",
    "training.warmup_steps": "the schedule is this run's, at the resumed step",
    "training.weight_decay": "written into the restored optimizer",
    "training.adam_beta1": "written into the restored optimizer",
    "training.adam_beta2": "written into the restored optimizer",
    "training.adam_eps": "written into the restored optimizer",
    "training.micro_batch_size": "the plan restarts at it",
    "memory.levers": "the plan restarts with it",
    "checkpoint.format": "the checkpoint is read by the format its manifest names (another format's whole state, "
                         "as another engine's: an fp16 loss scaler starts afresh); the next save is in the new one",
}
"""Settings besides the levers' whose change on resume needs a rule (the rule, as logged). Every
other key that is not must-match is read from this run's config when the run is built, so its
change takes effect as it would in a new run (cadences, engine tuning, logging, faults, …)."""
SCHEDULE_KEYS = ("training.max_steps", "training.lr", "training.min_lr_ratio", "training.warmup_steps")
"""The keys of memtrain's own learning-rate schedule; a Python caller's ``scheduler_factory``
schedule does not read them (its state is restored as saved)."""
RESTARTS_PLAN = "the plan restarts with it"
"""The rule of a lever whose ``on_resume`` is ``restarts_plan``."""


@dataclass(frozen=True)
class ResumeRules:
    """The two classes of settings on resume (this module's docstring).

    Attributes:
        must_match: config keys (``section.key``) a resumed run must keep.
        takes_effect: config keys whose change needs a rule → the rule, as logged.
    """

    must_match: tuple[str, ...]
    takes_effect: Mapping[str, str]

    @classmethod
    def with_levers(cls, lever_rules: Mapping[str, str]) -> "ResumeRules":
        """The rules with the levers' (``config_key → on_resume``: ``must_match``,
        ``restarts_plan`` or ``takes_effect``; :func:`memtrain.levers.resume_rules`)."""
        return cls(MUST_MATCH + tuple(key for key, rule in lever_rules.items() if rule == "must_match"),
                   {**TAKES_EFFECT, **{key: RESTARTS_PLAN for key, rule in lever_rules.items() if rule == "restarts_plan"}})

    def words(self, user_schedule: bool = False) -> dict[str, str]:
        """Each changed key's rule as the resume log says it (``backend.name``: an engine switch);
        ``user_schedule``: the learning-rate schedule is a Python caller's ``scheduler_factory``,
        which :data:`SCHEDULE_KEYS` do not drive."""
        own = "the scheduler_factory's schedule carries on from its saved state"
        return {**self.takes_effect, "backend.name": "converted on load",
                **({key: own for key in SCHEDULE_KEYS if key in self.takes_effect} if user_schedule else {})}

    def classes(self, config: dict) -> dict[str, str]:
        """:func:`settings_classes` under these rules."""
        return settings_classes(config, self.must_match)

    def changed(self, manifest: dict, config: dict) -> dict[str, list]:
        """:func:`changed_settings` under these rules."""
        return changed_settings(manifest, config, self.must_match)

    def check(self, path: str, manifest: dict, config: dict, identity: Optional[str]) -> None:
        """:func:`check_resumable` under these rules."""
        check_resumable(path, manifest, config, identity, self.must_match)


def settings_classes(config: dict, must_match: tuple[str, ...], prefix: str = "") -> dict[str, str]:
    """Every leaf key of ``config`` (a :func:`memtrain.config.to_dict`; ``model.config``,
    ``data.speech`` and the list values are leaves) → ``must_match`` (in ``must_match``) or
    ``takes_effect``."""
    out = {}
    for key, value in config.items():
        dotted = prefix + key
        if isinstance(value, dict) and dotted not in ("model.config", "data.speech"):
            out.update(settings_classes(value, must_match, dotted + "."))
        else:
            out[dotted] = "must_match" if dotted in must_match else "takes_effect"
    return out


def changed_settings(manifest: dict, config: dict, must_match: tuple[str, ...]) -> dict[str, list]:
    """The settings that take effect on resume (not in ``must_match``) and differ from the
    checkpoint's: key → ``[checkpoint's value, this run's]`` (``model.config`` keys one by one)."""
    saved = manifest.get("config") or {}
    saved_keys, changed = _flat_keys(saved), {}
    for key, kind in settings_classes(config, must_match).items():
        if kind != "takes_effect" or key in ("resume",):
            continue
        before, now = _get(saved, key), _get(config, key)
        if key == "model.config":
            for sub in sorted(set(before or {}) | set(now or {})):
                if (before or {}).get(sub) != (now or {}).get(sub):
                    changed[f"model.config.{sub}"] = [(before or {}).get(sub), (now or {}).get(sub)]
        elif before != now and key in saved_keys:
            changed[key] = [before, now]
    return changed


def _flat_keys(config: dict) -> set[str]:
    return set(settings_classes(config, ()))  # the leaf keys alone


def data_identity(corpus) -> Optional[str]:
    """The corpus cache's name (a hash of the files' contents and the tokenizer settings), a
    Python caller's examples' ``identity`` (:mod:`memtrain.data.examples`), or None."""
    if getattr(corpus, "identity", None):
        return corpus.identity
    directory = getattr(getattr(corpus, "tokenized", None), "directory", None) or getattr(corpus, "directory", None)
    return os.path.basename(os.path.normpath(directory)) if directory else None


def _get(config: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        config = config.get(part, {}) if isinstance(config, dict) else {}
    return config if config != {} else None


def check_resumable(path: str, manifest: dict, config: dict, identity: Optional[str],
                    must_match: tuple[str, ...]) -> None:
    """Refuse to resume ``path`` when a setting its data position depends on, or another of
    ``must_match``, has changed.

    Args:
        path: the checkpoint (for the message).
        manifest: its manifest (``config`` and ``data_identity`` as saved).
        config: this run's config as a dict (:func:`memtrain.config.to_dict`).
        identity: :func:`data_identity` of this run's corpus.
        must_match: the must-match keys (:attr:`ResumeRules.must_match`), the data position's first.

    Raises:
        ConfigError: naming the changed setting, the saved and the current value.
    """
    saved = manifest.get("config") or {}
    saved_identity = manifest.get("data_identity")
    known = saved_identity is not None and identity is not None
    for key in DATA_POSITION_KEYS + (() if known else DATA_KEYS):
        before, now = _get(saved, key), _get(config, key)
        if before != now:
            raise ConfigError(key, f"is {now!r} but checkpoint {path} was saved with {before!r}; resuming would "
                              "skip or repeat samples. Use the saved value, or start a new run (resume never, or "
                              "another output_dir)")
    saved_keys = _flat_keys(saved)
    placement_auto = _get(config, "backend.offload") == "auto"
    for key in must_match[len(DATA_POSITION_KEYS) + len(DATA_KEYS):]:
        if key in ENGINE_KEYS or (placement_auto and key in PLACEMENT_KEYS):
            continue  # compared as resolved: the engine by EngineState, an auto placement is the checkpoint's
        before, now = _get(saved, key), _get(config, key)
        if key in OLDER_DEFAULTS and key not in saved_keys:
            before, saved_keys = OLDER_DEFAULTS[key], saved_keys | {key}  # what a checkpoint before the key used
        if key in saved_keys and before != now:  # another key older checkpoints lack is not compared
            raise ConfigError(key, f"is {now!r} but checkpoint {path} was saved with {before!r}; this setting "
                              "cannot change on resume (docs/checkpoints.md, \"Changing settings on resume\"). Use "
                              "the saved value, or start a new run (resume never, or another output_dir)")
    if known and saved_identity != identity:
        examples = str(identity).startswith("examples-") or str(saved_identity).startswith("examples-")
        what = ("train_dataset", "the examples' number or content changed, or data from the config took their place"
                ) if examples else ("data.files", "a file's contents or the tokenizer changed" if "data_split" in manifest
                                    else "a file's contents or the tokenizer changed, or the checkpoint was saved by an "
                                    "older memtrain, which held out other files for validation (by a hash of their "
                                    "names alone; today's split is by bytes): resume it with that version")
        raise ConfigError(what[0], f"the data differs from what checkpoint {path} was trained on (corpus "
                          f"{identity}, saved {saved_identity}: {what[1]}); resuming would "
                          "continue at a position in other data. Restore the data, or start a new run")
