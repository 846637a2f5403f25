"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through ``peft``:
the adapters of ``model.lora_rank`` added to a built model, and a peft model's two exports (the
merged model ``transformers`` loads, or the adapter folder ``peft`` loads).

Only the adapters require gradients; the engines, the optimizer builders and the accounting
(:class:`memtrain.memory.shape.ModelShape`'s ``trainable``) read ``requires_grad``, so the
gradients and optimizer state of a LoRA run are the adapters' alone and the frozen base is held
in its dtype. ``peft`` is imported only here, and only for a LoRA run (it takes seconds).
"""

from __future__ import annotations

import copy
import warnings
from typing import Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from memtrain.errors import ConfigError
from memtrain.extras import require
from memtrain.meta import meta_copy


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft`` model (``PeftModel`` or a subclass), without importing peft."""
    return any(c.__module__.startswith("peft.") and c.__name__ == "PeftModel" for c in type(model).__mro__)


def apply_lora(model: nn.Module, model_cfg) -> nn.Module:
    """``model`` with LoRA adapters of rank ``model_cfg.lora_rank`` on ``lora_target_modules``
    (``peft.get_peft_model``; the base's parameters frozen, the adapters initialised by peft
    from the RNG, so equally seeded ranks build the same adapters); ``model`` itself when the rank
    is 0. The adapters take the dtype and device of the weights beside them (meta in a meta build).

    Raises:
        ConfigError: ``model.lora_target_modules`` names no module of the model, or is needed (a
            model type peft has no default for); ``model.lora_rank``: peft is not installed.
    """
    rank = getattr(model_cfg, "lora_rank", 0) or 0
    if rank <= 0:
        return model
    require("lora", "model.lora_rank", "LoRA")
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=model_cfg.lora_alpha, lora_dropout=model_cfg.lora_dropout,
                        target_modules=model_cfg.lora_target_modules, task_type=_task_type(model))
    try:
        return _with_adapters(model, config)
    except ValueError as exc:  # no default targets for this model, or targets that match nothing
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))
                        or type(m).__name__ == "Conv1D"})
        raise ConfigError("model.lora_target_modules", f"{exc} (the model's linear layers: {', '.join(names)})") from None


def _with_adapters(model: nn.Module, config) -> nn.Module:
    """``peft.get_peft_model(model, config)`` without the warnings it gives as it goes: GPT-2's
    Conv1D (peft sets ``fan_in_fan_out`` itself and says so) and transformers' deprecated
    ``is_gradient_checkpointing``, which peft asks."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(fan_in_fan_out|is_gradient_checkpointing).*")
        return get_peft_model(model, config)


def _task_type(model: nn.Module) -> Optional[str]:
    """peft's task type for a transformers model (a causal LM's adds ``generate``); None otherwise."""
    return "CAUSAL_LM" if hasattr(model, "generate") and hasattr(model, "config") else None


def merged(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The base model of peft model ``model`` with ``state_dict`` (its full weights, on CPU)
    loaded and the adapters merged into the base weights (``merge_and_unload``), and that model's
    state dict: what ``transformers`` loads without peft. Neither ``model`` nor the tensors of
    ``state_dict`` (which may be the live model's) is changed: a meta copy takes the weights by
    assignment, and each merged weight is a new tensor (peft's ``safe_merge``), so the export holds
    the adapted weights twice, the rest once.
    """
    twin = _meta_twin(model)
    twin.load_state_dict(state_dict, assign=True)
    base = twin.merge_and_unload(safe_merge=True)
    if hasattr(base, "tie_weights"):  # assignment gave tied weights (GPT-2's embedding and head) a tensor each
        base.tie_weights()
    return base, base.state_dict()


def _meta_twin(model: nn.Module) -> nn.Module:
    """A peft model like ``model`` on the meta device: a transformers base built again from its
    config (the class the engine wrapped: FSDP2 gives a sharded module a class of its own, which
    cannot be copied) with the same adapters; another module, a meta copy."""
    base = model.get_base_model()
    config = getattr(base, "config", None)
    cls = next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))
    if config is None or not hasattr(cls, "_from_config"):
        return meta_copy(model)
    with torch.device("meta"):
        return _with_adapters(cls._from_config(config), copy.deepcopy(model.peft_config[model.active_adapter]))


def save_adapter(model: nn.Module, state_dict: dict[str, torch.Tensor], directory: str) -> None:
    """Write peft model ``model``'s adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained`` loads onto the base
    model) with the adapter weights of ``state_dict`` into ``directory``."""
    model.save_pretrained(directory, state_dict=state_dict)
