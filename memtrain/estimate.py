"""What a run will need, before it runs: bytes of parameters, gradients and optimizer state per
engine, ZeRO stage and offload, and the activations of one probe micro-batch measured with and
without activation checkpointing.

    memtrain memory --config recipes/code_lm_350m.yaml [--world_size 8] [--section.key value ...]

prints one JSON object. Each engine accounts for its own model state (``model_state_bytes`` in
``memtrain/backends/``, following the ZeRO paper, Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", §3.1 and §5). Transient buffers (one
gathered block under FSDP2/ZeRO-3, communication buckets) are not counted.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Optional

import torch
from torch import nn

ENGINE_VARIANTS = {
    "ddp": ("ddp", None, "none"),
    "fsdp": ("fsdp", None, "none"),
    "fsdp_offload": ("fsdp", None, "optimizer_and_params"),
    "zero1": ("deepspeed", 1, "none"),
    "zero2": ("deepspeed", 2, "none"),
    "zero3": ("deepspeed", 3, "none"),
    "zero3_offload_optimizer": ("deepspeed", 3, "optimizer"),
    "zero3_offload_all": ("deepspeed", 3, "optimizer_and_params"),
}


class _SavedTensorCounter:
    """Counts the bytes autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``),
    each storage once. Inside a non-reentrant activation-checkpointed region torch's own hooks
    take over and keep nothing but the region's inputs, which is what makes the count drop."""

    def __init__(self):
        self.bytes = 0
        self._seen: set[int] = set()

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def activation_bytes(model: nn.Module, micro_batch: dict[str, torch.Tensor], activation_checkpointing: bool,
                     every_n_blocks: int = 1, objective=None) -> int:
    """Bytes of activations one training forward keeps for backward (a copy of ``model`` is used).

    Args:
        model: the unwrapped model (not modified).
        micro_batch: ``input_ids`` and ``labels`` int64 [B, T] (or what ``objective`` takes).
        activation_checkpointing: measure with activation checkpointing on.
        every_n_blocks: checkpoint every n-th block when on.
        objective: a :mod:`memtrain.objectives` objective; None = causal LM.

    Returns:
        Bytes saved for backward by the forward and the loss.
    """
    from memtrain.activation import enable_activation_checkpointing
    from memtrain.backends.common import repeated_blocks
    from memtrain.objectives import CausalLM

    objective = objective or CausalLM()
    probe = copy.deepcopy(model).train()
    if activation_checkpointing:
        enable_activation_checkpointing(probe, repeated_blocks(probe), every_n_blocks)
    counter = _SavedTensorCounter()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        loss = objective.loss_sum(probe, micro_batch)
    del loss
    return counter.bytes


def report(cfg, world_size: int) -> dict:
    """The memory report of a config: model-state bytes for every engine variant at
    ``world_size`` ranks, and measured activation bytes of one micro-batch (``micro_batch_size``
    samples of ``seq_len`` tokens) with activation checkpointing off and on.

    Returns:
        A JSON-serialisable dict; ``per_rank_total_bytes`` adds activations (off/on) to each variant.
    """
    from accelerate.utils import set_seed

    from memtrain.backends import model_state_bytes
    from memtrain.data import build_corpus
    from memtrain.models import build_model, count_parameters
    from memtrain.objectives import make_objective
    from memtrain.precision import resolve_precision

    precision = resolve_precision(cfg.precision, "cuda" if torch.cuda.is_available() else "cpu")
    corpus = build_corpus(cfg.data)
    set_seed(cfg.training.seed)
    model = build_model(cfg.model, corpus.vocab_size, cfg.training.seed)
    objective = make_objective(model, corpus)
    n = count_parameters(model)
    batch = corpus.train.batch(list(range(cfg.training.micro_batch_size)))
    acts = {"off": activation_bytes(model, batch, False, objective=objective),
            "on": activation_bytes(model, batch, True, cfg.memory.activation_checkpointing_every_n_blocks, objective)}
    engines = {name: model_state_bytes(e, n, precision, s, o, world_size) for name, (e, s, o) in ENGINE_VARIANTS.items()}
    state_bytes = {name: sum(v for k, v in e.items() if k != "cpu_offloaded_bytes") for name, e in engines.items()}
    return {
        "parameters": n, "precision": precision, "world_size": world_size,
        "micro_batch_size": cfg.training.micro_batch_size, "seq_len": cfg.data.seq_len,
        "activation_bytes": acts, "model_state_bytes": engines,
        "per_rank_total_bytes": {name: {ac: b + a for ac, a in acts.items()} for name, b in state_bytes.items()},
        "note": "activations of one micro-batch in fp32 compute (bf16 autocast roughly halves them); "
                "transient gathered blocks and communication buckets are not counted",
    }


def main(argv: Optional[list[str]] = None) -> int:
    """``memtrain memory [--world_size N] --config ... [--section.key value ...]``: print the report."""
    from memtrain.config import ConfigError, parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if "--world_size" in argv:
        i = argv.index("--world_size")
        world_size = int(argv[i + 1])
        del argv[i:i + 2]
    try:
        cfg = parse_args(argv)
    except ConfigError as exc:
        print(f"memtrain memory: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report(cfg, world_size), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
