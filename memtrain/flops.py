"""Model FLOPs utilisation (MFU): the FLOPs a step's tokens need, against the device's peak.

FLOPs per token of training = ``6 × parameters`` (forward and backward of every weight) plus
``12 × layers × hidden size × sequence length`` for attention scores and values (Chowdhery et
al. 2022, "PaLM", appendix B). Recomputation (activation checkpointing) is not counted: MFU
measures useful work, not hardware work. Peaks are the dense bf16 tensor-core figures of the
vendors' data sheets; a device not in :data:`PEAK_BF16_FLOPS` gets no MFU.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from memtrain.models import count_parameters

PEAK_BF16_FLOPS = (  # (substrings of torch.cuda.get_device_name(), dense bf16 FLOP/s), first match wins
    (("H200",), 989e12),
    (("H100", "PCIe"), 756e12),
    (("H100", "NVL"), 835e12),
    (("H100",), 989e12),  # SXM
    (("A100",), 312e12),
    (("L40S",), 362e12),
    (("L4",), 121e12),
)


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """Dense bf16 peak (FLOP/s) of a GPU by its name, or None when not known."""
    for parts, flops in PEAK_BF16_FLOPS:
        if all(p in device_name for p in parts):
            return flops
    return None


def flops_per_token(model: nn.Module, n_params: int, seq_len: int) -> Optional[float]:
    """Training FLOPs per token of a transformers causal LM (``num_hidden_layers``,
    ``hidden_size`` in its config); None for other models (no MFU). 2 per parameter forward, 2
    for the inputs' gradients backward, 2 more for the weight gradients of the parameters that
    train (all of them: the usual 6N; a LoRA model's adapters only), plus attention's."""
    config = getattr(model, "config", None)
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if not layers or not hidden:
        return None
    return 4.0 * n_params + 2.0 * count_parameters(model, trainable=True) + 12.0 * layers * hidden * seq_len


def mfu(tokens_per_s: float, per_token: Optional[float], peak: Optional[float], world_size: int) -> Optional[float]:
    """Fraction of ``world_size`` devices' peak that ``tokens_per_s`` (all ranks) used; None
    when the FLOPs per token or the peak are not known."""
    if not per_token or not peak:
        return None
    return tokens_per_s * per_token / (peak * world_size)
