"""How a model is built for DeepSpeed (the engine's ``model_build_context``): under ZeRO-3 already
partitioned — ``model.pretrained`` through transformers' DeepSpeed integration
(``HfDeepSpeedConfig``: rank 0 reads the weights and hands each rank its partition), a Python
caller's model function inside ``deepspeed.zero.Init`` — so no rank holds the whole model;
otherwise the model is built as it would be without DeepSpeed. And which linear a ZeRO-3 run
computes with (DeepSpeed's memory-efficient one, whichever way the model was built), given back
at the engine's close.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def model_build_context(cfg, spec, precision: str, world_size: int, python_function: bool = False):
    """Where the model is built. ZeRO-3 with ``model.pretrained``: transformers' ``from_pretrained``
    builds it already partitioned (``deepspeed.zero.Init``) and only rank 0 reads the weights,
    handing each rank its partition (transformers' ``HfDeepSpeedConfig`` integration), so no rank
    holds the whole model. ZeRO-3 with a Python caller's model function (``python_function``): the
    function runs inside ``deepspeed.zero.Init``, which partitions each submodule's parameters as
    soon as it is built (every rank builds the same values from the same seed, then keeps its
    part). Otherwise nothing changes."""
    stage, user = (spec.zero_stage, spec.deepspeed_json) if cfg.model.pretrained or python_function else (0, {})
    if stage != 3:
        yield
        return
    share = cfg.training.global_batch_size // max(1, world_size)
    zero = {"stage": 3, **{k: v for k, v in (user.get("zero_optimization") or {}).items() if k == "offload_param"},
            "memory_efficient_linear": False}  # zero.Init's config overrides its mem_efficient_linear= argument
    settings = {"zero_optimization": zero, "bf16": {"enabled": precision == "bf16"},
                "fp16": {"enabled": precision == "fp16"}, "train_micro_batch_size_per_gpu": share,
                "train_batch_size": share * max(1, world_size)}
    if python_function:
        import deepspeed
        # before zero.Init, which replaces torch.Tensor.__new__: torch._dynamo's polyfills compare
        # its signature when first imported (TypeError "Signature mismatch" from a model function
        # whose transformers modeling code imports it first: GPT-2's, torch 2.13)
        import torch._dynamo  # noqa: F401

        # the parameters' dtype comes from the bf16/fp16 flags (fp32 with neither): an explicit
        # dtype= is overridden by bf16 on a CPU without fp16 (DeepSpeed 0.19's Init._set_dtype);
        # transformers told too: a function calling from_config initializes the weights gathered
        # (else its init writes into the empty partitions: GPT-2's validation loss 40 after 3 steps)
        with _transformers_zero3(settings), deepspeed.zero.Init(config_dict_or_path=settings, mem_efficient_linear=False):
            yield
        return
    with _transformers_zero3(settings):
        yield


@contextlib.contextmanager
def _transformers_zero3(settings: dict):
    """transformers' ZeRO-3 integration on (``HfDeepSpeedConfig``) while inside: its models build
    partitioned and initialize their weights gathered (``initialize_weights_zero3``)."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(settings)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del keep


def use_memory_efficient_linear() -> None:
    """Run ZeRO-3's own linear (``zero3_linear_wrap``) in place of torch's, as DeepSpeed's ZeRO-3
    engine does itself when it partitions a model built whole (``zero_optimization.
    memory_efficient_linear``, on by default): it saves a layer's weight itself for backward, where
    torch's linear saves a view (``weight.t()``) that keeps the gathered weight alive after its
    release until backward. A model built already partitioned (``deepspeed.zero.Init``, where
    memtrain turns it off for the build: :mod:`memtrain.backends.ds_zero_init`) gets it here, so
    both hold the same bytes (:func:`memtrain.memory.step_trace.step_peaks`' ``linear_saves_weight``).
    :func:`restore_torch_linear` gives torch's back at the engine's close."""
    from deepspeed.runtime.zero import partition_parameters as pp

    holder = pp.InsertPostInitMethodToModuleSubClasses
    if not hasattr(holder, "linear_bk"):
        holder.linear_bk = torch.nn.functional.linear
    if torch.nn.functional.linear is holder.linear_bk:
        torch.nn.functional.linear = pp.zero3_linear_wrap


def restore_torch_linear() -> None:
    """Put torch's ``torch.nn.functional.linear`` back where ZeRO-3 replaced it. DeepSpeed's
    ``zero.Init`` (which its ZeRO-3 engine enters too) swaps in its memory-efficient linear
    (``zero3_linear_wrap``, a custom autograd function) for the whole process and never restores
    it (DeepSpeed 0.19, ``InsertPostInitMethodToModuleSubClasses.linear_bk`` keeps the original),
    so a Python caller's later code — another engine's run, or their own — would run DeepSpeed's
    linear. Nothing happens when DeepSpeed was never imported or left it alone."""
    import sys

    module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    saved = getattr(getattr(module, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    if saved is not None and torch.nn.functional.linear is getattr(module, "zero3_linear_wrap", None):
        torch.nn.functional.linear = saved  # only DeepSpeed's own swap: a caller's later one stays
