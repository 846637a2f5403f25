"""What a run will need, before it runs: bytes of parameters, gradients and optimizer state per
engine, ZeRO stage and offload, and the activations of one probe micro-batch measured with and
without activation checkpointing.

    memtrain memory --config recipes/code_lm_350m.yaml [--world_size 8] [--section.key value ...]

prints one JSON object. The model-state accounting follows the ZeRO paper (Rajbhandari et al.
2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §3.1 and §5): AdamW
keeps two fp32 moments (8 bytes/parameter); DeepSpeed in bf16/fp16 keeps 16-bit parameters and
gradients plus an fp32 master copy in the optimizer; Accelerate's autocast (DDP) and FSDP2's
mixed-precision policy keep fp32 parameters and gradients and cast for compute. Transient
buffers (one gathered block under FSDP2/ZeRO-3, communication buckets) are not counted.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Optional

import torch
from torch import nn

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32, per parameter


def model_state_bytes(n_params: int, precision: str, engine: str, zero_stage: Optional[int] = None,
                      offload: str = "none", world_size: int = 1) -> dict[str, int]:
    """Per-rank bytes of model state for AdamW training.

    Args:
        n_params: number of parameters.
        precision: ``bf16|fp16|fp32`` (resolved).
        engine: ``ddp|fsdp|deepspeed``.
        zero_stage: 1, 2 or 3 for DeepSpeed (default 2).
        offload: ``none|optimizer|optimizer_and_params``.
        world_size: ranks that share the sharded state.

    Returns:
        ``parameter_bytes``, ``gradient_bytes``, ``optimizer_bytes`` on the accelerator (per
        rank), and ``cpu_offloaded_bytes`` (per rank, in host memory).

    Raises:
        ValueError: an unknown engine (names the field ``backend.name`` and the choices).
    """
    n, w = n_params, max(1, world_size)
    half = precision in ("bf16", "fp16")
    if engine == "ddp":
        params, grads, optim = 4 * n, 4 * n, ADAM_STATE_BYTES * n
        offloaded = 0
    elif engine == "fsdp":
        params, grads, optim = 4 * n // w, 4 * n // w, ADAM_STATE_BYTES * n // w
        offloaded = 0
        if offload != "none":  # FSDP2's CPUOffloadPolicy moves all three
            params, grads, optim, offloaded = 0, 0, 0, params + grads + optim
    elif engine == "deepspeed":
        stage = 2 if zero_stage is None else zero_stage
        p_bytes = 2 if half else 4
        master = 4 if half else 0  # fp32 master weights live with the optimizer state
        params = p_bytes * n // (w if stage >= 3 else 1)
        grads = p_bytes * n // (w if stage >= 2 else 1)
        optim = (ADAM_STATE_BYTES + master) * n // (w if stage >= 1 else 1)
        offloaded = 0
        if offload in ("optimizer", "optimizer_and_params"):
            offloaded, optim = optim, 0
        if offload == "optimizer_and_params":
            offloaded, params = offloaded + params, 0
    else:
        raise ValueError(f"backend.name: '{engine}' is not one of ddp, fsdp, deepspeed")
    return {"parameter_bytes": params, "gradient_bytes": grads, "optimizer_bytes": optim,
            "cpu_offloaded_bytes": offloaded}


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
                     checkpoint_every: int = 1, objective=None) -> int:
    """Bytes of activations one training forward keeps for backward (a copy of ``model`` is used).

    Args:
        model: the unwrapped model (not modified).
        micro_batch: ``input_ids`` and ``labels`` int64 [B, T] (or what ``objective`` takes).
        activation_checkpointing: measure with activation checkpointing on.
        checkpoint_every: checkpoint every k-th block when on.
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
        enable_activation_checkpointing(probe, repeated_blocks(probe), checkpoint_every)
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
            "on": activation_bytes(model, batch, True, cfg.memory.checkpoint_every, objective)}
    engines = {name: model_state_bytes(n, precision, e, s, o, world_size) for name, (e, s, o) in ENGINE_VARIANTS.items()}
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
