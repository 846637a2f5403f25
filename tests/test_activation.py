"""Activation checkpointing: same losses and gradients as without it (fp32), on a transformers
GPT-2 and a plain module, under DDP and FSDP2 (and GPT-2 under ZeRO-3) on 2 CPU ranks; and less
activation memory."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import ENGINES, STEPS, TINY_ARGS, TINY_BASE_ARGS, launch, read_metrics, tiny_args

RUN = ["--training.max_steps", str(STEPS)]
MODELS = {
    # dropout on: the recompute must replay the same dropout masks
    "gpt2": ["--model.config.resid_pdrop", "0.1", "--model.config.attn_pdrop", "0.1"],
    "plain": ["--model.factory", "toy_models:make_stack", "--model.config", "{}"],
}


def run(out, cache_dir, engine, model, ac):
    launch(tiny_args(out, cache_dir, *RUN, *ENGINES[engine], *MODELS[model],
                     "--memory.activation_checkpointing", ac, model=model == "gpt2"))
    weights = load_file(str(out / "model" / "model.safetensors"))
    return read_metrics(out), weights


@pytest.mark.slow
# DDP (which reduces after backward) and the engines that communicate inside the recomputed blocks
@pytest.mark.parametrize("engine,model", [("ddp", "gpt2"), ("fsdp", "gpt2"), ("fsdp", "plain"), ("zero3", "gpt2")])
def test_activation_checkpointing_keeps_losses_and_gradients(tmp_path, cache_dir, engine, model):
    """Full and selective checkpointing train like no checkpointing on 2 ranks, dropout on
    (ZeRO-3 refuses selective: test_levers)."""
    off, w_off = run(tmp_path / "off", cache_dir, engine, model, "off")
    for ac in ("on", "selective") if engine != "zero3" else ("on",):
        on, w_on = run(tmp_path / ac, cache_dir, engine, model, ac)
        assert [r["activation_checkpointing"] for r in on] == [ac] * len(off)  # the setting was in effect
        for a, b in zip(off, on):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
        # STEPS optimizer steps from the same start: equal weights mean equal gradients
        assert w_off.keys() == w_on.keys()
        for name in w_off:
            torch.testing.assert_close(w_on[name], w_off[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("model", list(MODELS))
def test_activation_checkpointing_lowers_probe_activation_bytes(cache_dir, model):
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.estimate import activation_bytes
    from memtrain.models import build_model

    cfg = parse_args((TINY_BASE_ARGS + MODELS[model] if model == "plain" else TINY_ARGS + ["--model.config.n_layer", "4"])
                     + ["--data.cache_dir", cache_dir])
    corpus = build_corpus(cfg.data)
    net = build_model(cfg.model, corpus.tokenized.vocab_size)
    batch = corpus.train.batch(list(range(4)))
    off = activation_bytes(net, batch, "off")
    on = activation_bytes(net, batch, "on")
    half = activation_bytes(net, batch, "on", every_n_blocks=2)
    selective = activation_bytes(net, batch, "selective")
    assert on < half < off and on < selective < off
    assert not any(getattr(b, "gradient_checkpointing", False) for b in net.modules())  # the probe copied the model


@pytest.mark.parametrize("model", ["gpt2", "plain"])
def test_selective_checkpointing_keeps_gradients_bitwise_and_the_matmul_outputs(model):
    """Selective checkpointing (fp32, GPT-2 with dropout on, and a plain module): the loss and every
    gradient bitwise equal to no checkpointing; the simulated device counts what it keeps — less
    than off, more than full checkpointing — and all of it is released after backward."""
    import copy

    from toy_models import make_stack
    from transformers import GPT2Config, GPT2LMHeadModel

    from memtrain.levers.activation_checkpointing import enable_activation_checkpointing
    from memtrain.models import repeated_blocks
    from memtrain.memory.simulated import SimulatedMemory

    torch.manual_seed(0)
    if model == "gpt2":
        net = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=32, vocab_size=64,
                                         resid_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0))
    else:
        net = make_stack(64)
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    results = {}
    for ac in ("off", "selective", "on"):
        probe = copy.deepcopy(net).train()
        if ac != "off":
            enable_activation_checkpointing(probe, repeated_blocks(probe), mode=ac)
        memory = SimulatedMemory(2**40, 0, probe.parameters())
        torch.manual_seed(2)  # the same dropout masks in every run
        with memory.context():
            out = probe(input_ids=ids, labels=ids).loss if model == "gpt2" else probe(ids).float().pow(2).mean()
        out.backward()
        results[ac] = out.detach(), [p.grad for p in probe.parameters()], memory.peak_bytes, memory.saved_bytes
    for ac in ("selective", "on"):
        assert torch.equal(results[ac][0], results["off"][0])
        assert all(torch.equal(a, b) for a, b in zip(results[ac][1], results["off"][1]))
    assert results["on"][2] < results["selective"][2] < results["off"][2]
    assert all(r[3] == 0 for r in results.values())  # nothing counted outlives backward


def test_memory_report_cli(cache_dir, capsys):
    from memtrain.estimate import main

    assert main(["--world_size", "4"] + TINY_ARGS + ["--data.cache_dir", cache_dir]) == 0
    report = json.loads(capsys.readouterr().out)
    n = report["parameters"]
    states = report["model_state_bytes"]
    assert states["ddp"]["optimizer_bytes"] == 8 * n
    # fp32; every parameter of the tiny model is under ZeRO-3's persistence threshold (1e5
    # elements, DeepSpeed's default), so each rank holds them whole beside its quarter (the
    # partition stays in ZeRO-3's flat buffer: DeepSpeed's fp16_partitioned_groups_flat)
    assert states["zero3"]["parameter_bytes"] == 4 * n + 4 * n // 4
    # AdamW's moments and ZeRO's fp32 master partition (a copy also for an fp32 model), over 4 ranks
    assert states["zero3"]["optimizer_bytes"] == (8 + 4) * n // 4
    # parameter offload moves the partitioned parameters; the whole small ones stay on the device
    assert states["zero3_offload_all"]["parameter_bytes"] == 4 * n and states["zero3_offload_all"]["cpu_offloaded_bytes"] > 0
    assert report["activation_bytes"]["on"] < report["activation_bytes"]["selective"] < report["activation_bytes"]["off"]
    # every engine's peak with AC on at most its peak with it off (the optimizer step may be the
    # peak of both); not ZeRO-3 below DDP: with every parameter whole beside its partition this
    # model holds more under ZeRO-3, and DDP's gradients are not yet there at its loss's peak
    totals = report["per_rank_total_bytes"]
    assert all(t["on"] <= t["off"] for t in totals.values()) and totals["ddp"]["on"] < totals["ddp"]["off"]


@pytest.mark.parametrize("model", ["gpt2", "plain"])
def test_compiled_blocks_train_like_eager_and_stay_compiled(model):
    """training.compile: each block's forward is compiled (aot_eager here: the wiring, not the
    code generator); losses and gradients equal eager within 1e-3 at every micro-batch size and
    with activation checkpointing switched on and off; sizes seen before compile nothing new."""
    import copy

    from torch._dynamo.utils import counters

    from memtrain.levers.activation_checkpointing import disable_activation_checkpointing, enable_activation_checkpointing
    from memtrain.models import repeated_blocks
    from memtrain.transforms import compile_forwards

    torch._dynamo.reset()
    torch.manual_seed(0)
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        eager = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                                           eos_token_id=0, bos_token_id=0, use_cache=False, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0)).train()
    else:
        from toy_models import make_stack

        eager = make_stack(vocab_size=64, dropout=0.0).train()  # compiled dropout draws its masks otherwise
    compiled = copy.deepcopy(eager)
    blocks = repeated_blocks(compiled)
    compile_forwards(blocks, backend="aot_eager")

    def step(m, batch):
        x = torch.randint(0, 64, (batch, 16), generator=torch.Generator().manual_seed(batch))
        out = m(input_ids=x)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
        loss.backward()
        return loss.item()

    def check(batch):
        eager.zero_grad(), compiled.zero_grad()
        assert step(compiled, batch) == pytest.approx(step(eager, batch), rel=1e-3)
        for a, b in zip(eager.parameters(), compiled.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-5)

    for batch in (4, 2, 3):  # new sizes recompile until the batch dimension is dynamic
        check(batch)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # the blocks really run compiled
    check(5), check(2)
    assert counters["stats"]["unique_graphs"] == graphs  # another plan's size: nothing new to compile
    for cycle in range(2):  # checkpointing on and off, as the OOM protocol and the planner switch it
        enable_activation_checkpointing(compiled, blocks)
        enable_activation_checkpointing(eager, repeated_blocks(eager))
        check(3)
        disable_activation_checkpointing(compiled, blocks)
        disable_activation_checkpointing(eager, repeated_blocks(eager))
        check(4)
        if cycle == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs  # each state compiled once, then reused
    assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks)  # still the compiled forwards


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_language_models_use_scaled_dot_product_attention(model_type):
    """transformers' SDPA attention (FlashAttention/memory-efficient kernels on CUDA), not the eager
    softmax(QK^T)V that materialises the [heads, T, T] scores."""
    from memtrain.config import ModelConfig
    from memtrain.models import build_model

    config = ({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32} if model_type == "gpt2"
              else {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                    "num_attention_heads": 2, "max_position_embeddings": 32})
    with torch.device("meta"):
        model = build_model(ModelConfig(config=config), 64)
    assert model.config._attn_implementation == "sdpa"
