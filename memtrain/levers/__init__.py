"""Memory levers as data (:mod:`memtrain.levers.base`): the registry and the one place a plan's
lever settings are applied.

Order matters only for messages and for the OOM recovery without a planner, which at the
micro-batch floor moves the first lever that has a more memory-saving choice left.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from memtrain.errors import ConfigError
from memtrain.levers.activation_checkpointing import ActivationCheckpointing
from memtrain.levers.activation_offload import ActivationOffload
from memtrain.levers.base import Lever, LeverCost, LeverTarget, PlanFacts
from memtrain.levers.chunked_cross_entropy import ChunkedCrossEntropy
from memtrain.levers.engine_settings import OffloadOptimizerRatio, ReshardAfterForward
from memtrain.levers.optimizer_state import OptimizerStateDtype

LEVERS: tuple[Lever, ...] = (ActivationCheckpointing(), ChunkedCrossEntropy(), ActivationOffload(),
                             ReshardAfterForward(), OffloadOptimizerRatio(), OptimizerStateDtype())
"""Every lever memtrain has, in the order the OOM recovery escalates them."""

__all__ = ["LEVERS", "Lever", "LeverCost", "LeverTarget", "PlanFacts", "lever", "lever_choices", "allowed_by",
           "apply_levers", "validate", "recompute_fraction", "block_period", "copy_bytes_per_s", "plan_cost",
           "resume_rules", "describe", "plan_words",
           "lever_events", "first_settings", "restore_settings", "offered_choices"]


def lever(name: str) -> Lever:
    """The lever called ``name``.

    Raises:
        KeyError: no such lever.
    """
    for candidate in LEVERS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no memory lever '{name}' (levers: {', '.join(x.name for x in LEVERS)})")


def lever_choices(cfg, spec, model_only: bool = False) -> dict[str, tuple]:
    """``{lever name: its choices}`` for the levers the run of ``cfg`` on engine ``spec`` has
    (``spec`` None: model levers only, e.g. ``memtrain plan`` before an engine is chosen;
    ``model_only``: model levers only, as the engine ``spec`` allows them).

    Raises:
        memtrain.errors.ConfigError: a lever's config field asks for what the run cannot do.
    """
    return {x.name: x.choices(cfg, spec) for x in LEVERS
            if (x.model_lever or (spec is not None and not model_only)) and x.applies(cfg, spec)}


def allowed_by(choices: dict[str, tuple], cfg, spec) -> dict[str, tuple]:
    """``choices`` less the model-lever settings engine ``spec`` refuses (ZeRO-3: selective AC),
    e.g. for a placement of another engine than the config's. A config that asks for what the
    engine refuses keeps its choices here (its run names the field)."""
    try:
        allowed = lever_choices(cfg, spec, model_only=True)
    except ConfigError:
        return choices
    return {name: tuple(v for v in options if v in allowed.get(name, options)) or options
            for name, options in choices.items()}


def offered_choices(cfg, spec, source=None, objective=None) -> dict[str, tuple]:
    """:func:`lever_choices`, less what the run's model or objective cannot take: chunked
    cross-entropy is offered (``memory.levers auto``) only to memtrain's causal-LM objective on a
    config's model (``source``: the :class:`memtrain.models.ModelSource`, None = the config's;
    ``objective`` None = memtrain's)."""
    choices = lever_choices(cfg, spec)
    user = source is not None and getattr(source, "user", None) is not None
    if "chunked_cross_entropy" in choices and (user or (objective is not None and not hasattr(objective, "chunked"))):
        choices["chunked_cross_entropy"] = choices["chunked_cross_entropy"][:1]
    return choices


def validate(cfg, python: frozenset = frozenset()) -> None:
    """Every lever's :meth:`Lever.validate` of ``cfg`` (``python``: what a Python caller passed).

    Raises:
        memtrain.errors.ConfigError: a lever's field asks for what it cannot mean (names the field).
    """
    for x in LEVERS:
        x.validate(cfg, python)


def first_settings(choices: dict[str, tuple]) -> dict[str, Any]:
    """Each lever's first (fastest) choice: the settings a run starts with before the planner or
    OOM recovery moves them."""
    return {name: options[0] for name, options in choices.items()}


def apply_levers(target: LeverTarget, settings: dict[str, Any], model_levers: bool | None = None) -> None:
    """Put ``settings`` (a plan's ``{lever: setting}``) into effect on ``target``.

    Args:
        model_levers: True = only levers that transform the model (before the engine wraps it);
            False = only engine settings; None = all.
    """
    for name, setting in settings.items():
        x = lever(name)
        if model_levers is None or x.model_lever == model_levers:
            x.apply(target, setting)


def restore_settings(saved: Any) -> dict[str, Any]:
    """A checkpoint's ``{lever: setting}`` as this version names the settings (levers this
    version does not have are kept as they are); a planner table written before levers existed
    holds activation checkpointing's setting alone (not a dict)."""
    if not isinstance(saved, dict):
        saved = {ActivationCheckpointing.name: saved}
    names = {x.name for x in LEVERS}
    return {name: lever(name).restore(value) if name in names else value for name, value in saved.items()}


def saved_plan_levers(state: dict) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """``(the plan's {lever: setting}, the grown-from plan's or None)`` of a checkpoint's plan
    state (:meth:`memtrain.plan.PlanController.state_dict`); one written before levers existed
    holds activation checkpointing's alone, under its name and ``grown_from_ac``."""
    ac = ActivationCheckpointing.name
    levers = state.get("levers", {ac: state[ac]} if ac in state else {})
    grown = state.get("grown_from_levers", {ac: state["grown_from_ac"]} if "grown_from_ac" in state else None)
    return levers, grown


def recompute_fraction(settings: dict[str, Any], cfg) -> float:
    """Extra forwards per step the settings cost (fraction of one forward, summed over levers)."""
    return sum(lever(name).recompute_fraction(setting, cfg) for name, setting in settings.items())


def block_period(settings: dict[str, Any], cfg) -> int:
    """Blocks per repeat of what the levers' ``settings`` do to the model's blocks: the least common
    multiple of each lever's :meth:`Lever.block_period` (1 = every block alike)."""
    return math.lcm(1, *(lever(name).block_period(setting, cfg) for name, setting in settings.items()))


def copy_bytes_per_s(cfg) -> float:
    """The rate (bytes/s) a plan's host copies are charged at where they are not timed (a CPU run,
    ``memtrain plan``): :class:`PlanFacts`' ``copy_bytes_per_s``, the activation offload lever's field."""
    return ActivationOffload.copy_bytes_per_s(cfg)


def plan_cost(settings: dict[str, Any], facts: PlanFacts) -> LeverCost:
    """What the levers' ``settings`` cost the plan of ``facts`` beyond its traced bytes and its
    recompute, summed over levers (:meth:`Lever.cost`; a lever this version does not have: nothing)."""
    names = {x.name for x in LEVERS}
    return sum((lever(name).cost(setting, facts) for name, setting in settings.items() if name in names), LeverCost())


def resume_rules() -> dict[str, str]:
    """``{config key: what its change does on resume}`` of every lever (:attr:`Lever.on_resume`),
    for :meth:`memtrain.checkpoint.compat.ResumeRules.with_levers`."""
    return {x.config_key: x.on_resume for x in LEVERS}


def describe(settings: dict[str, Any]) -> str:
    """The settings in words (`` + AC + chunked CE``); empty when every lever is plain."""
    words = [lever(name).describe(setting) for name, setting in settings.items()]
    return "".join(f" {w}" for w in words if w)


def plan_words(settings: dict[str, Any]) -> str:
    """A plan's levers in words for a sentence: each lever named whatever its setting
    (:attr:`Lever.named_as`: ``activation checkpointing off``), then every other one that
    ``settings`` turn on (``chunked CE``), comma-separated (``activation checkpointing off, chunked
    CE, activation offload``); a named lever missing from ``settings`` is said ``off``."""
    words = [f"{x.named_as} {x.restore(settings.get(x.name, 'off'))}" for x in LEVERS if x.named_as]
    words += [lever(name).describe(setting).removeprefix("+ ") for name, setting in settings.items()
              if name in {x.name for x in LEVERS if not x.named_as}]
    return ", ".join(w for w in words if w)


def lever_events() -> frozenset[str]:
    """Metrics events the levers add (e.g. ``activation_checkpointing_on``)."""
    return frozenset(event for x in LEVERS for event in x.events())

