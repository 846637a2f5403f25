"""Chunked cross-entropy as a lever (``memory.chunked_cross_entropy``): a language model's output
layer computes the summed loss in checkpointed chunks of tokens, never the whole [tokens, vocab]
logits. Switchable between steps: the chunked output layer is installed once and used only while
the objective asks for it. The declaration (:class:`ChunkedCrossEntropy`) and the mechanism
(:func:`install_chunked_head`, :func:`cross_entropy_sum`, below) are this one module.

Cross-entropy over the vocabulary in chunks of tokens, never holding the whole ``[tokens, vocab]``
logits (``memory.chunked_cross_entropy``).

A causal LM's loss is usually computed from logits [B·T, V] kept for backward in fp32: for a
50k vocabulary and 16 × 1024 tokens that is 3.3 GB, more than all the other activations of a
small model. Here the output layer computes the summed loss itself, a chunk of tokens at a time,
each chunk under ``torch.utils.checkpoint`` (non-reentrant), so a chunk's logits exist only while
that chunk is computed, in forward and again in backward; backward keeps the hidden states
[B·T, H] and nothing of size V. The price is one more output-layer matmul per token in backward.
The idea is Liger Kernel's fused linear cross-entropy (which on CUDA does the same in fused
kernels); this is the plain PyTorch form that runs on every device and engine, with chunks of at
most :data:`CHUNK_LOGITS_BYTES` of logits.

The output layer is patched in place (its ``forward`` replaced on the instance), so the engines'
own hooks (DDP, FSDP2's unshard, ZeRO-3's parameter fetch) see an ordinary module call and the
weight is available exactly as it is for the plain loss. The loss reaches the objective as the
model output's ``logits`` field (a scalar) while :func:`labels_for_head` is active.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain.data import IGNORE_INDEX
from memtrain.errors import ConfigError
from memtrain.levers.base import ConfigField, Lever, LeverTarget

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
"""transformers causal LMs whose logits are exactly ``lm_head(hidden_states)`` (no scaling,
soft-capping or bias added afterwards), so the head may compute the loss in their place."""


@dataclass
class _HeadCall:
    labels: torch.Tensor
    used: bool = False


_CALL: contextvars.ContextVar[Optional[_HeadCall]] = contextvars.ContextVar("memtrain_head_call", default=None)


CHUNK_LOGITS_BYTES = 64 * 2**20
"""A chunk's fp32 logits are at most this large (bytes): the transient cost of the loss, whatever
the micro-batch. Larger chunks than Liger Kernel's (logits ≈ the hidden states' size), because
each chunk costs a Python-level checkpoint region here, not a fused kernel launch."""


def chunk_tokens(vocab_size: int, max_bytes: int = CHUNK_LOGITS_BYTES) -> int:
    """Tokens per chunk: as many as fit fp32 logits of ``max_bytes`` bytes (at least 1)."""
    return max(1, max_bytes // (4 * vocab_size))


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (nats) of logits [N, V] against labels int64 [N] (-100 =
    ignored), the softmax in fp32 for half-precision logits (it loses digits in fp16/bf16). The
    plain loss and each chunk of the chunked one."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                labels: torch.Tensor) -> torch.Tensor:
    return cross_entropy_sum(F.linear(hidden, weight, bias), labels)


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                              labels: torch.Tensor, chunk: Optional[int] = None) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, labels, reduction="sum")`` without the full logits.

    Args:
        hidden: [..., H] final hidden states (any float dtype; autocast applies as usual).
        weight: [V, H] output-layer weight; bias: [V] or None.
        labels: int64 [...] (the shape of ``hidden`` without H); -100 = ignored.
        chunk: tokens per chunk; None = :func:`chunk_tokens`.

    Returns:
        The summed loss (nats), a scalar: fp32 for half-precision logits, else the logits' dtype.
        Its gradient equals the plain loss's up to the order of summation.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"hidden states hold {h.shape[0]} tokens, labels {y.shape[0]}")
    step = chunk or chunk_tokens(weight.shape[0])
    total = None
    for start in range(0, h.shape[0], step):
        part = checkpoint(_chunk_loss, h[start:start + step], weight, bias, y[start:start + step], use_reentrant=False)
        total = part if total is None else total + part
    return total


def install_chunked_head(model: nn.Module) -> nn.Module:
    """Make ``model``'s output layer compute the chunked loss while :func:`labels_for_head` is
    active (and plain logits otherwise).

    Args:
        model: an unwrapped transformers causal LM of :data:`SUPPORTED_MODEL_TYPES`.

    Returns:
        The output layer (an ``nn.Linear``).

    Raises:
        ConfigError: the model is not one whose logits are a plain linear output layer
            (field ``memory.chunked_cross_entropy``).
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if model_type not in SUPPORTED_MODEL_TYPES or not isinstance(head, nn.Linear):
        raise ConfigError("memory.chunked_cross_entropy",
                          f"needs a transformers causal LM of type {', '.join(SUPPORTED_MODEL_TYPES)} "
                          f"(logits = a linear output layer); this model is {model_type or type(model).__name__}")
    if getattr(head, "_memtrain_chunked", False):
        return head

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        call = _CALL.get()
        if call is None or call.used:
            return nn.Linear.forward(head, hidden)
        call.used = True
        return chunked_cross_entropy_sum(hidden, head.weight, head.bias, call.labels)

    head.forward = forward
    head._memtrain_chunked = True
    return head


@contextlib.contextmanager
def labels_for_head(labels: torch.Tensor) -> Iterator[_HeadCall]:
    """Within the block, a chunked output layer (:func:`install_chunked_head`) returns the summed
    loss against ``labels`` (int64 [B, T]) instead of logits; ``call.used`` tells whether it did."""
    call = _HeadCall(labels)
    token = _CALL.set(call)
    try:
        yield call
    finally:
        _CALL.reset(token)


class ChunkedCrossEntropy(Lever):
    """Settings: bool."""

    name = "chunked_cross_entropy"
    escalate_event = "chunked_cross_entropy_on"
    column = "chunked CE"
    config_key = "memory.chunked_cross_entropy"
    config_fields = (
        ConfigField("chunked_cross_entropy", "bool", False,
                    "Language models: the output layer computes the cross-entropy a chunk of tokens at a time, "
                    "recomputing each chunk's logits in backward, so the [tokens, vocab] logits are never held "
                    f"(memtrain/levers/chunked_cross_entropy.py; {', '.join(SUPPORTED_MODEL_TYPES)}). Saves vocab × 4 "
                    "bytes per token of activations for one more output-layer matmul per token."),)
    auto_words = "chunked cross-entropy (a config's language model, when memory.chunked_cross_entropy is false)"
    by_hand = "true"

    def validate(self, cfg, python: frozenset = frozenset()) -> None:
        if "objective" in python and cfg.memory.chunked_cross_entropy:
            raise ConfigError("memory.chunked_cross_entropy", "is for memtrain's causal-LM objective; a Python "
                              "objective computes its own loss (set it false)")

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
