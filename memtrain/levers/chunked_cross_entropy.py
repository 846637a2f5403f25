"""Chunked cross-entropy as a lever (``memory.chunked_cross_entropy``): a language model's output
layer computes the summed loss in checkpointed chunks of tokens, never the whole [tokens, vocab]
logits (:mod:`memtrain.chunked_loss`). Switchable between steps: the chunked output layer is
installed once and used only while the objective asks for it."""

from __future__ import annotations

from memtrain.chunked_loss import SUPPORTED_MODEL_TYPES, install_chunked_head
from memtrain.errors import ConfigError
from memtrain.levers.base import Lever, LeverTarget


class ChunkedCrossEntropy(Lever):
    """Settings: bool."""

    name = "chunked_cross_entropy"
    escalate_event = "chunked_cross_entropy_on"
    column = "chunked CE"
    config_key = "memory.chunked_cross_entropy"

    def choices(self, cfg, spec) -> tuple:
        if cfg.memory.chunked_cross_entropy and cfg.data.kind == "speech":
            raise ConfigError("memory.chunked_cross_entropy", "is for causal language models; the CTC loss has no "
                              "[tokens, vocab] logits to chunk (set it false)")
        if (not cfg.memory.chunked_cross_entropy and getattr(cfg.memory, "levers", "off") == "auto"
                and cfg.data.kind == "text" and getattr(cfg.model, "factory", None) is None
                and (getattr(cfg.model, "config", None) or {}).get("model_type") in SUPPORTED_MODEL_TYPES):
            return (False, True)  # the solver may turn it on (memory.levers auto): a config's language model
        return (bool(cfg.memory.chunked_cross_entropy),)

    def apply(self, target: LeverTarget, setting) -> None:
        if setting and not hasattr(target.objective, "chunked"):
            raise ConfigError("memory.chunked_cross_entropy", f"is for memtrain's causal-LM objective; this run's "
                              f"{type(target.objective).__name__} computes its own loss (set it false)")
        if setting:
            install_chunked_head(target.model)  # ConfigError for a model whose logits are not one linear layer
        if hasattr(target.objective, "chunked"):
            target.objective.chunked = bool(setting)

    def describe(self, setting) -> str:
        return "+ chunked CE" if setting else ""

    def stop_words(self, setting) -> str:
        return "chunked cross-entropy" if setting else ""

    def stop_advice(self, setting, engine) -> str:
        return "" if setting else "memory.chunked_cross_entropy true"

    def floor_note(self, setting, choices: tuple) -> str:
        return "" if setting else "(memory.chunked_cross_entropy is off)"
