"""LayerDrop that every rank agrees on (Fan et al. 2019, "Reducing Transformer Depth on Demand
with Structured Dropout"; the ``layerdrop`` of fairseq's and transformers' wav2vec 2.0 / WavLM).

transformers draws each layer's skip decision from ``torch.rand`` in the encoder loop. On
several ranks those draws differ (each rank's random stream has consumed different amounts,
e.g. for dropout on batches of other lengths), so ranks skip different layers: DDP then fails
with "Expected to have finished reduction in the prior iteration" unless its unused-parameter
search is on, and an engine that communicates per layer (FSDP2's all-gather / reduce-scatter,
ZeRO-3's parameter fetch) pairs one rank's collectives with another rank's different ones —
transformers therefore switches LayerDrop off under FSDP/ZeRO-3 (its ``synced_gpus``).

memtrain instead decides once per optimizer step from ``(seed, step, layer)``: every rank and
every micro-batch of the step skip the same layers, engines stay in step, and the decision does
not depend on how the global batch is split into micro-batches (an OOM retry with a smaller
micro-batch drops the same layers). The first layer is never dropped (WavLM computes its
relative position bias there; transformers never drops it either).
"""

from __future__ import annotations

import functools

import numpy as np
from torch import nn

_PASS_THROUGH = {
    # what a skipped layer returns, built from its inputs, per transformers layer class
    "WavLM": lambda args, kwargs: (args[0], kwargs.get("position_bias")),
}


def _hidden_states(args, kwargs):
    """wav2vec2 / HuBERT layers return the hidden states alone."""
    return args[0] if args else kwargs["hidden_states"]


class AgreedLayerDrop:
    """Skips whole transformer layers in training, the same ones on every rank.

    Args:
        layers: the encoder's layers, in order.
        probability: chance that a layer (other than the first) is skipped in a step.
        seed: with the step number, determines the decisions.

    Attributes:
        dropped: indices of the layers skipped in the current step.
    """

    def __init__(self, layers: nn.ModuleList, probability: float, seed: int):
        if not 0.0 <= probability < 1.0:
            raise ValueError(f"layerdrop must be in [0, 1), got {probability}")
        self.probability, self.seed = probability, seed
        self.layers = list(layers)
        self.dropped: list[int] = []
        for index, layer in enumerate(self.layers):
            if index > 0:  # the pass-through is chosen now: FSDP2 later renames the class (FSDPWavLM…)
                through = next((f for prefix, f in _PASS_THROUGH.items() if type(layer).__name__.startswith(prefix)),
                               _hidden_states)
                layer.forward = functools.partial(self._forward, index, layer, layer.forward, through)

    def set_step(self, step: int) -> list[int]:
        """Draw the decisions of optimizer step ``step``; returns the skipped layers' indices."""
        draws = np.random.default_rng([self.seed, step, 0x1D]).random(len(self.layers))
        self.dropped = [i for i in range(1, len(self.layers)) if draws[i] < self.probability]
        return self.dropped

    def _forward(self, index: int, layer: nn.Module, forward, through, *args, **kwargs):
        if layer.training and index in self.dropped:
            return through(args, kwargs)
        return forward(*args, **kwargs)


def install_layerdrop(model: nn.Module, seed: int) -> AgreedLayerDrop | None:
    """Move a transformers speech model's ``config.layerdrop`` into :class:`AgreedLayerDrop`.

    The model's own LayerDrop is switched off (``config.layerdrop = 0``); the probability stays
    readable as ``model.memtrain_layerdrop.probability`` (DDP's unused-parameter detection looks
    there).

    Returns:
        The installed LayerDrop, or None when the model has none (no ``encoder.layers`` or
        ``layerdrop`` 0).
    """
    config = getattr(model, "config", None)
    probability = float(getattr(config, "layerdrop", 0.0) or 0.0)
    encoder = None
    for name, module in model.named_modules():  # e.g. wavlm.encoder (WavLMEncoderStableLayerNorm)
        if name.split(".")[-1] == "encoder" and isinstance(getattr(module, "layers", None), nn.ModuleList):
            encoder = module
            break
    if probability <= 0 or encoder is None:
        return None
    config.layerdrop = 0.0
    model.memtrain_layerdrop = AgreedLayerDrop(encoder.layers, probability, seed)
    return model.memtrain_layerdrop
