"""Operators a fake-tensor trace (:mod:`memtrain.memory.step_trace`) runs in place of the real
ones: those whose meta kernels cannot take the trace's inputs (``aten._grouped_mm`` in fp32,
CTC's data-dependent shapes) and the fused attention kernel a GPU runs (planned on a machine
without one)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def grouped_mm_in_dtype(func, args: tuple, kwargs: dict) -> torch.Tensor:
    """``aten._grouped_mm`` of fp32 (or fp16) inputs on fake tensors: torch's meta kernel checks
    for the CUDA kernel's bf16, while the CPU kernel takes fp32 (transformers' fused MoE experts
    in an fp32 run, Mixtral's and Qwen2-MoE's ``grouped_mm``): the bf16 call's output, in the
    inputs' dtype (the casts are not counted: they happen below this mode)."""
    dtype = args[0].dtype
    cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    return func(*cast, **kwargs).to(dtype)


def _ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, *_) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._ctc_loss`` on fake tensors, whose output shapes depend on the target lengths' values:
    the loss per utterance and the forward variables ``log_alpha`` [B, T, 2 S + 1] at the longest
    target the padded ``targets`` [B, S] hold (Graves et al. 2006; torch's CPU and CUDA kernels)."""
    frames, batch = log_probs.shape[:2]
    longest = targets.shape[-1] if targets.dim() == 2 else targets.numel()
    return log_probs.new_empty((batch,)), log_probs.new_empty((batch, frames, 2 * longest + 1))


CTC = {torch.ops.aten._ctc_loss.Tensor: _ctc_loss,
        torch.ops.aten._ctc_loss_backward.Tensor: lambda grad, log_probs, *_: log_probs.new_empty(log_probs.shape)}
"""CTC's operators on fake tensors (their shapes from the padded targets' length, an upper bound);
the backward also allocates, and frees inside itself, ``log_beta`` of ``log_alpha``'s size."""


class _FusedAttention(torch.autograd.Function):
    """What a GPU's fused attention (FlashAttention's or the memory-efficient SDPA kernel) holds:
    its output and a float32 log-sum-exp per query saved for backward, beside the inputs autograd
    keeps anyway; never the [batch, heads, queries, keys] weights nor a dropout mask (the kernel
    draws the mask again from its RNG state in backward). Source: Dao et al., "FlashAttention"
    (2022), section 3.1; torch's ``_scaled_dot_product_flash_attention`` returns the same."""

    @staticmethod
    def forward(ctx, query, key, value):
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


@contextlib.contextmanager
def fused_attention(active: bool):
    """Within the block, ``torch.nn.functional.scaled_dot_product_attention`` holds what a GPU's
    fused kernel holds (:class:`_FusedAttention`) when ``active``: a GPU planned on a machine
    without one traces on the meta device, where attention would take the math path (its weights,
    and with dropout its mask and the pre-dropout weights, saved: +48 GiB of a 121 GiB micro-step
    at 16 × 1024 tokens of GPT-2 medium with attn_pdrop 0.1)."""
    if not active:
        yield
        return
    real = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return _FusedAttention.apply(query, key, value)
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real
