"""LoRA (``model.lora_rank``; a peft model from Python): only the adapters train and hold
gradients and optimizer state, the planner counts that and its peak is checked against
MemTracker, a run resumes on another engine, and the export is the merged model transformers
loads and generates with (or, with ``--adapter_only``, the adapter folder peft loads)."""

import json
import os

import pytest
import torch

from conftest import launch, read_metrics, tiny_args
from memtrain.config import ConfigError, ModelConfig, parse_args
from memtrain.memory.accounting import ddp_state_bytes, fsdp_state_bytes
from memtrain.memory.zero_accounting import zero_state_bytes
from memtrain.memory.shape import model_shape
from memtrain.models import build_model
from memtrain.optim import make_optimizer

LORA = ("--model.lora_rank", "8", "--training.lr", "0.01")
GPT2 = dict(model_type="gpt2", n_layer=2, n_embd=32, n_head=2, n_positions=32)


def lora_model(rank: int = 8):
    torch.manual_seed(0)
    return build_model(ModelConfig(config=dict(GPT2), lora_rank=rank), 512)


def test_only_the_adapters_train_and_the_accounting_counts_the_optimizers_tensors():
    """After an optimizer step, memtrain's AdamW holds state for the adapters' tensors only, and
    the accounting's gradient and optimizer bytes are the bytes of those tensors (counted from
    the optimizer and the gradients, not from the accounting's formula); the frozen base holds
    its parameters in their dtype. Without LoRA every parameter has state."""
    model = lora_model()
    adapters = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and {id(p) for p in model.parameters() if p.requires_grad} == adapters
    optimizer = make_optimizer(model, parse_args([]).training)
    ids = torch.randint(0, 512, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    state = optimizer.state
    assert {id(p) for p in state} == adapters
    moments = sum(t.numel() * t.element_size() for s in state.values() for k, t in s.items() if k != "step")
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    shape = model_shape(model)
    total = sum(p.numel() for p in model.parameters())
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    ddp = ddp_state_bytes(total, 1, shape)
    assert (ddp["optimizer_bytes"], ddp["gradient_bytes"]) == (moments, grads)
    assert ddp["parameter_bytes"] == grads + frozen  # the adapters in fp32 beside the frozen base
    fsdp = fsdp_state_bytes(total, "fp32", "none", 2, shape)
    assert fsdp["optimizer_bytes"] == moments // 2
    zero2 = zero_state_bytes(total, "fp32", 2, "none", 2, 1.0, "cpu", shape)
    assert zero2["optimizer_bytes"] == (moments + grads) // 2  # the moments and an fp32 master, sharded
    full = model_shape(build_model(ModelConfig(config=dict(GPT2)), 512))
    assert ddp_state_bytes(total, 1, full)["optimizer_bytes"] > 20 * moments
    assert full.blocks == GPT2["n_layer"]  # FSDP2's units besides the root


@pytest.mark.parametrize("bad, field", [
    (["--model.lora_rank", "-1"], "model.lora_rank"),
    (["--model.lora_rank", "8", "--model.lora_dropout", "1.0"], "model.lora_dropout"),
    (["--model.lora_rank", "8", "--backend.name", "fsdp", "--backend.offload", "optimizer"], "backend.offload"),
    (["--model.lora_rank", "8", "--model.lora_target_modules", "[no_such_layer]"], "model.lora_target_modules"),
])
def test_bad_lora_settings_are_refused_by_name(bad, field, tmp_path):
    from memtrain.validation import validate

    with pytest.raises(ConfigError) as err:
        cfg = parse_args(["--config", "recipes/code_lm_tiny.yaml", "--output_dir", str(tmp_path), *bad])
        validate(cfg, 1)
        build_model(cfg.model, 512)
    assert err.value.field == field


@pytest.mark.slow
def test_lora_trains_resumes_on_another_engine_and_exports_a_model_transformers_loads(tmp_path, cache_dir):
    """2 ranks: a LoRA run on DDP (6 steps) and the same run stopped at step 3 and resumed on FSDP2
    give the same losses; the frozen base in the last checkpoint equals the freshly built one
    (only the adapters moved); the planner's peak (``memtrain plan``'s) is within −2% / +5% of
    MemTracker's count of step 1 (step 1: MemTracker itself keeps two activations of every
    checkpointed micro-batch alive under LoRA, so a later step's count grows with the steps run,
    while the process's resident memory without MemTracker stays flat over 300 micro-batches);
    the export is the merged model: transformers loads it without peft, its logits equal the peft
    model's, and it generates; ``--adapter_only`` writes the folder peft loads."""
    from memtrain.checkpoint.formats import read_full_weights
    from memtrain.checkpoint.layout import latest_checkpoint, verify
    from memtrain.estimate import plan_report
    from memtrain.weights import load_into
    from memtrain.memory.accounting import without_allocator_headroom

    whole, part = tmp_path / "whole", tmp_path / "part"
    common = (*LORA, "--training.global_batch_size", "4", "--checkpoint.every_steps", "3",
              "--memory.activation_checkpointing", "on")
    launch(tiny_args(whole, cache_dir, *common, "--training.max_steps", "6", "--logging.memory_breakdown_step", "1"))
    launch(tiny_args(part, cache_dir, *common, "--training.max_steps", "3"))
    resumed = launch(tiny_args(part, cache_dir, *common, "--training.max_steps", "6", "--backend.name", "fsdp"))
    assert "resum" in resumed.stderr.lower() + resumed.stdout.lower()
    losses = [r["loss"] for r in read_metrics(whole) if "loss" in r]
    again = [r["loss"] for r in read_metrics(part) if "loss" in r]
    assert len(losses) == 6 and again == pytest.approx(losses, rel=1e-5)
    assert losses[-1] < losses[0]

    cfg = parse_args(tiny_args(whole, cache_dir, *common, "--training.micro_batch_size", "2"))
    report = plan_report(cfg, 2)
    row = next(c for c in report["candidates"] if c["micro_batch_size"] == 2)
    predicted = without_allocator_headroom(row["predicted_peak_bytes"], report["machine"]["device_type"])
    with open(whole / "memory_breakdown" / "rank_00000.json") as fh:
        counted = json.load(fh)["peak_bytes"]
    assert -0.02 <= (predicted - counted) / counted <= 0.05, (predicted, counted)

    path = latest_checkpoint(str(whole / "checkpoints"))
    weights = read_full_weights(path, verify(path))
    torch.manual_seed(cfg.training.seed)  # the run's seed: its base and its adapters as first built
    fresh = build_model(cfg.model, verify(path)["vocab_size"])
    first = fresh.state_dict()
    assert any("lora_" in name for name in weights)
    for name, tensor in weights.items():
        assert torch.equal(tensor, first[name]) == ("lora_" not in name), name

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(whole / "model"))
    assert not any("lora" in k for k in exported.state_dict())
    load_into(fresh, weights)
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        assert torch.allclose(exported.eval()(ids).logits, fresh.eval()(input_ids=ids).logits, atol=1e-5)
    assert exported.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 16)

    from memtrain.export import export_checkpoint
    from peft import PeftModel

    adapter = export_checkpoint(str(whole), str(tmp_path / "adapter"), adapter_only=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    torch.manual_seed(cfg.training.seed)
    base = build_model(ModelConfig(config=cfg.model.config), verify(path)["vocab_size"])
    loaded = PeftModel.from_pretrained(base, adapter)
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(input_ids=ids).logits, fresh(input_ids=ids).logits, atol=1e-5)
