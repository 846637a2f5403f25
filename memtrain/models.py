"""Build a model from the recipe: a transformers config (no hub download) or a factory.

``model.config`` with a ``model_type`` (gpt2, llama, mistral, …) builds
``AutoModelForCausalLM.from_config``; ``model.factory: package.module:function`` calls the
function with ``vocab_size=`` and the ``model.config`` keys and expects an ``nn.Module`` mapping
``input_ids`` [B, T] to logits [B, T, V] (a tensor or an object with ``.logits``).
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
from torch import nn

from memtrain.config import ConfigError, ModelConfig
from memtrain.layerdrop import install_layerdrop
from memtrain.lora import apply_lora
from memtrain.meta import meta_copy


def load_factory(spec: str):
    """Import ``package.module:function``.

    Raises:
        ConfigError: malformed spec, module or attribute not found (field ``model.factory``).
    """
    import os
    import sys

    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:  # like `python -m`: the user's own modules in the working directory
        sys.path.append(os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("model.factory", f"cannot load '{spec}': {exc}") from None


def ctc_model_types() -> list[str]:
    """transformers model types with a CTC head (wav2vec2, wavlm, hubert, …)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CTC_MAPPING_NAMES

    return sorted(MODEL_FOR_CTC_MAPPING_NAMES)


def check_model_type(model_type) -> None:
    """Refuse a ``model_type`` transformers does not know, naming it and the close matches only
    (transformers' own error lists all ~400 types on one line).

    Raises:
        ConfigError: field ``model.config.model_type``.
    """
    import difflib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return
    close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING_NAMES), n=4, cutoff=0.6)
    raise ConfigError("model.config.model_type", f"'{model_type}' is not a model type transformers knows"
                      + (f"; close matches: {', '.join(close)}" if close else "; e.g. gpt2, llama, qwen2, wav2vec2"))


def build_model(model_cfg: ModelConfig, vocab_size: int, seed: int = 0, eos_token_id: Optional[int] = None) -> nn.Module:
    """Instantiate the model with freshly initialised weights (seed the RNG before calling).

    A transformers model type with a CTC head (wav2vec2, wavlm, hubert, …) is built with
    ``AutoModelForCTC`` (CTC blank = ``pad_token_id`` 0); its ``layerdrop`` is taken over by
    :class:`memtrain.layerdrop.AgreedLayerDrop`, which every rank agrees on. Any other type is
    built with ``AutoModelForCausalLM``.

    Args:
        model_cfg: the ``model`` section.
        vocab_size: the tokenizer's vocabulary size; used unless the config sets ``vocab_size``.
        seed: seeds the LayerDrop decisions (with the step number).
        eos_token_id: the tokenizer's end-of-text id: a causal LM's ``bos_token_id`` and
            ``eos_token_id`` (not the model type's defaults, such as GPT-2's 50256); None = keep
            the config's, or 0 when they lie outside the vocabulary.

    Returns:
        The model in fp32 on CPU, in train mode.

    Raises:
        ConfigError: unknown ``model_type`` or bad config keys (field ``model.config``); LoRA
            settings that do not fit the model (:func:`memtrain.lora.apply_lora`).

    With ``model.lora_rank`` set, the model carries LoRA adapters (a ``peft`` model) and only
    they require gradients.
    """
    if model_cfg.pretrained:
        return apply_lora(_from_pretrained(model_cfg, vocab_size, seed), model_cfg)
    return apply_lora(_fresh(model_cfg, vocab_size, seed, eos_token_id), model_cfg)


def _fresh(model_cfg: ModelConfig, vocab_size: int, seed: int, eos_token_id: Optional[int]) -> nn.Module:
    """:func:`build_model` of ``model.config`` or ``model.factory`` (fresh weights, no adapters)."""
    kwargs = dict(model_cfg.config or {})
    kwargs.setdefault("vocab_size", vocab_size)
    if kwargs["vocab_size"] < vocab_size:
        raise ConfigError("model.config.vocab_size", f"{kwargs['vocab_size']} is smaller than the tokenizer's {vocab_size}")
    if model_cfg.factory:
        try:
            model = load_factory(model_cfg.factory)(**kwargs)
        except TypeError as exc:  # the config keys do not fit the factory's signature
            raise ConfigError("model.config", f"{model_cfg.factory}: {exc}") from None
    else:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForCTC

        model_type = kwargs.pop("model_type")
        ctc = model_type in ctc_model_types()
        if ctc:
            kwargs.setdefault("pad_token_id", 0)  # the CTC blank
        elif eos_token_id is not None:  # set before the config exists, so it never holds the type's default
            kwargs.setdefault("bos_token_id", eos_token_id)
            kwargs.setdefault("eos_token_id", eos_token_id)
        check_model_type(model_type)
        try:
            hf_config = AutoConfig.for_model(model_type, **kwargs)
        except (ValueError, TypeError) as exc:
            raise ConfigError("model.config", str(exc)) from None
        hf_config.use_cache = False  # training only; no KV cache
        if ctc:
            model = AutoModelForCTC.from_config(hf_config)

            install_layerdrop(model, seed)
            no_waveform_gradient(model)
        else:
            if eos_token_id is not None:
                hf_config.bos_token_id = hf_config.eos_token_id = eos_token_id
            elif getattr(hf_config, "eos_token_id", None) is None or hf_config.eos_token_id >= vocab_size:
                hf_config.bos_token_id = hf_config.eos_token_id = 0
            hf_config.pad_token_id = None
            model = AutoModelForCausalLM.from_config(hf_config)
    return model.float().train()


def no_waveform_gradient(model: nn.Module) -> None:
    """Stop a transformers speech model's feature encoder from computing the waveform's gradient.

    Its feature encoder (``Wav2Vec2FeatureEncoder`` and its copies: WavLM, HuBERT, …) marks the
    waveform view it convolves as requiring a gradient when training (``_requires_grad``), for
    reentrant checkpointing. memtrain's activation checkpointing is non-reentrant and nothing reads
    that gradient: it costs a backward convolution into a [B, samples] fp32 tensor per
    micro-batch, and those tensors outlive their micro-batch until Python's cycle collector runs
    (MemTracker counted the four micro-batches' of one step alive when the next began; the speech
    family's rows were up to 7.9% under). The flag is turned off only where the convolutions are
    checkpointed whatever it says (transformers' ``GradientCheckpointingLayer``, since 5.0; before,
    the flag also gated their checkpointing): the encoder's parameters train as before, the same
    loss and gradients bitwise. A frozen encoder's flag is off already."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older transformers: the flag gates the convolutions' checkpointing too
        return
    for module in model.modules():
        layers = getattr(module, "conv_layers", None)
        if (type(module).__name__.endswith("FeatureEncoder") and hasattr(module, "_requires_grad") and layers
                and all(isinstance(layer, GradientCheckpointingLayer) for layer in layers)):
            module._requires_grad = False


def _from_pretrained(model_cfg: ModelConfig, vocab_size: int, seed: int) -> nn.Module:
    """``from_pretrained`` of the local folder ``model.pretrained`` (fp32, ``model.config`` as
    config overrides); a CTC model type gets the rank-agreed LayerDrop like a fresh one.

    Raises:
        ConfigError: the folder cannot be loaded, an override changes a weight's shape, or the
            tokenizer has more ids than the model's embeddings (fields ``model.pretrained`` /
            ``model.config``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForCTC

    path = model_cfg.pretrained
    overrides = {k: v for k, v in (model_cfg.config or {}).items() if k != "model_type"}
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True, **overrides)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError("model.pretrained", f"'{path}': {exc}") from None
    wanted = (model_cfg.config or {}).get("model_type")
    if wanted not in (None, hf_config.model_type):
        raise ConfigError("model.config.model_type", f"is '{wanted}', but model.pretrained '{path}' is a "
                          f"'{hf_config.model_type}' model")
    if getattr(hf_config, "vocab_size", vocab_size) < vocab_size:
        raise ConfigError("model.pretrained", f"'{path}' has {hf_config.vocab_size} token embeddings, fewer than the "
                          f"tokenizer's {vocab_size} ids")
    hf_config.use_cache = False
    ctc = hf_config.model_type in ctc_model_types()
    cls = AutoModelForCTC if ctc else AutoModelForCausalLM
    try:
        model = cls.from_pretrained(path, config=hf_config, dtype=torch.float32, local_files_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ConfigError("model.config" if overrides else "model.pretrained",
                          f"'{path}' cannot be loaded with these settings: {str(exc).splitlines()[0]}") from None
    if ctc:
        install_layerdrop(model, seed)
        no_waveform_gradient(model)
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # built partitioned by ZeRO-3, in its precision
        return model.train()
    return model.float().train()


def logits_of(output) -> torch.Tensor:
    """The logits tensor [B, T, V] of a model's output (tensor, or object with ``.logits``).

    Raises:
        ConfigError: field ``model``: the forward returned neither (``None``, a tuple, …).
    """
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ConfigError("model", f"its forward returned {type(output).__name__}"
                          f"{' (does it end without return?)' if output is None else ''}; the objective reads its "
                          "logits: return a tensor [batch, positions, vocabulary] or an object with .logits, or "
                          "give the Trainer an objective that reads what it returns")
    return logits


def count_parameters(model: nn.Module, trainable: bool = False) -> int:
    """Number of parameters (tied weights counted once; a ZeRO-3-partitioned parameter by its
    full size, ``ds_numel``); ``trainable``: only those that require gradients (a LoRA model's adapters)."""
    unique = {id(p): p for p in model.parameters() if p.requires_grad or not trainable}
    return sum(getattr(p, "ds_numel", p.numel()) for p in unique.values())


class ModelSource:
    """Where a run's model comes from: the config (``model.config``/``model.factory``/``model.pretrained``,
    :func:`build_model`) or the user's Python (:class:`memtrain.api.Trainer`): an ``nn.Module``
    already built, or a zero-argument function building one.

    The planners build the model without memory (:meth:`build_meta`: on the meta device, or a
    meta copy of a built module), the run builds it for real once (:meth:`build`).

    Args:
        model_cfg: the ``model`` section (used when ``user`` is None).
        vocab_size, seed, eos_token_id: as for :func:`build_model`.
        user: the user's module or model function; None = the config's model.
    """

    def __init__(self, model_cfg: ModelConfig, vocab_size: int, seed: int = 0, eos_token_id: Optional[int] = None,
                 user=None):
        self.model_cfg, self.vocab_size, self.seed, self.eos_token_id = model_cfg, vocab_size, seed, eos_token_id
        self.user = user

    @classmethod
    def of(cls, cfg, corpus, user=None) -> "ModelSource":
        """The source of ``cfg``'s model for ``corpus`` (its vocabulary and end-of-text id)."""
        return cls(cfg.model, getattr(corpus, "vocab_size", 0), cfg.training.seed, getattr(corpus, "eos_id", None), user)

    def build(self) -> nn.Module:
        """The model (seed the RNG first; inside an engine's build context for a partitioned build).

        Raises:
            ConfigError: as :func:`build_model`; a user's function that returns no ``nn.Module``.
        """
        if self.user is None:
            return build_model(self.model_cfg, self.vocab_size, self.seed, self.eos_token_id)
        model = self.user if isinstance(self.user, nn.Module) else self.user()
        if not isinstance(model, nn.Module):
            raise ConfigError("model", f"the model function returned {type(model).__name__}, not a torch.nn.Module")
        return model.train()

    def build_meta(self) -> nn.Module:
        """The model with every parameter and buffer on the meta device (no memory allocated)."""
        if isinstance(self.user, nn.Module):
            return meta_copy(self.user)
        with torch.device("meta"):
            return self.build()


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (transformer layers), the unit FSDP2 shards and activation
    checkpointing wraps.

    transformers models name their block classes in ``_no_split_modules`` (GPT2Block,
    LlamaDecoderLayer, …); for other modules (and transformers models that name none, such as
    WavLM), the children holding parameters of the ``nn.ModuleList`` with the most parameters —
    a speech model's transformer layers, not its convolutional feature encoder.

    Returns:
        Blocks in module order; empty when none is found.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    if names:
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        if blocks:
            return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return [child for child in largest if any(True for _ in child.parameters())]
