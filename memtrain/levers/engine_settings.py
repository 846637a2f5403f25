"""The engine settings that are levers, fixed when the engine is built: FSDP2's
``reshard_after_forward`` (free each block's gathered parameters after its forward, gather them
again in backward) and DeepSpeed ZeRO-3's optimizer-offload ratio (the fraction of the optimizer
state CPU Adam updates on the host; :mod:`memtrain.backends.ds_partial_offload`). The engine's
own accounting (:mod:`memtrain.memory.accounting`) reports the bytes each setting leaves on the
device; the placement planner chooses the ratio under ``backend.offload auto``."""

from __future__ import annotations

from memtrain.backends import engine_module
from memtrain.engine_names import ENGINES
from memtrain.errors import ConfigError
from memtrain.levers.base import Lever


class EngineSetting(Lever):
    """A lever the engine is built with: its bytes come from the engine's accounting, and it is
    fixed for the run (a plan asking for another setting is an error). An engine names the ones
    it has in its module's ``SETTINGS`` (:mod:`memtrain.backends`)."""

    model_lever = False
    runtime = False

    def engine_has(self, engine: str) -> bool:
        """Whether engine ``engine`` (a name of :data:`memtrain.engine_names.ENGINES`) is built with
        this setting: its module's ``SETTINGS`` names it."""
        return self.name in engine_module(engine).SETTINGS


class ReshardAfterForward(EngineSetting):
    """Settings: bool (FSDP2 only)."""

    name = "reshard_after_forward"
    column = "reshard"
    config_key = "backend.reshard_after_forward"
    on_resume = "takes_effect"

    def validate(self, cfg, python: frozenset = frozenset()) -> None:
        """``false`` (keep blocks gathered) only for an engine that reshards: one whose module's
        ``SETTINGS`` names this lever, or ``backend.name auto`` (which may still plan one)."""
        name = cfg.backend.name
        if cfg.backend.reshard_after_forward or name == "auto" or self.engine_has(name):
            return
        owners = " or ".join(n for n in ENGINES if self.engine_has(n))
        raise ConfigError(self.config_key, f"false is a setting of backend.name {owners}, but backend.name is "
                          f"'{name}'; use backend.name {owners} (or auto), or drop it")

    def applies(self, cfg, spec) -> bool:
        return spec is not None and self.engine_has(spec.name)

    def choices(self, cfg, spec) -> tuple:
        return (bool(spec.reshard_after_forward),)

    def describe(self, setting) -> str:
        return "" if setting else "blocks kept gathered"


class OffloadOptimizerRatio(EngineSetting):
    """Settings: float in (0, 1] (DeepSpeed with optimizer offload only)."""

    name = "offload_optimizer_ratio"
    column = "host share"
    config_key = "backend.offload_optimizer_ratio"
    on_resume = "must_match"

    def validate(self, cfg, python: frozenset = frozenset()) -> None:
        """A fraction in (0, 1], given by hand only where the planner does not choose it."""
        ratio = cfg.backend.offload_optimizer_ratio
        if not 0.0 < ratio <= 1.0:
            raise ConfigError("backend.offload_optimizer_ratio", f"must be in (0, 1] (the fraction of the optimizer "
                              f"state on the host), got {ratio}")
        if ratio < 1.0 and cfg.backend.offload == "auto":
            raise ConfigError("backend.offload_optimizer_ratio", "is chosen by the planner under backend.offload auto: "
                              "drop it")

    def applies(self, cfg, spec) -> bool:
        return spec is not None and self.engine_has(spec.name) and _offload(cfg, spec)[0] != "none"

    def choices(self, cfg, spec) -> tuple:
        return (_offload(cfg, spec)[1],)

    def describe(self, setting) -> str:
        return f"{setting:.0%} of the optimizer on the host" if setting < 1 else ""


def _offload(cfg, spec) -> tuple[str, float]:
    """``(offload, ratio)`` of the engine ``spec`` (its DeepSpeed JSON's folded in: :func:`memtrain.backends.spec.resolve_engine`)."""
    return spec.offload, float(spec.offload_optimizer_ratio)
