"""Meta copies of modules: the same structure, shapes and dtypes, no memory (the planners trace
them; the LoRA export merges into one)."""

from __future__ import annotations

import copy

import torch
from torch import nn


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same shapes and
    dtypes (tied parameters stay tied); the original is not touched and nothing is allocated."""
    memo: dict[int, object] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for b in module._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)
