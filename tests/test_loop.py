"""The loop's normalisation: the gradient does not depend on how a global batch is split."""

import pytest
import torch

from memtrain.data import IGNORE_INDEX
from memtrain.optim import lr_lambda
from memtrain.step import train_step
from memtrain.plan import Plan
from memtrain.objectives import CTC, CausalLM


@pytest.fixture(scope="module")
def backend():
    from memtrain.backends.ddp import DDPBackend
    from memtrain.distributed import ProcessState

    process = ProcessState(cpu=True)
    b = DDPBackend(process, "fp32")
    yield b
    b.close()
    process.close()


def _model(dtype=torch.float64):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).to(dtype).train()


def _batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 97, (8, 16), generator=g)
    labels = torch.randint(0, 97, (8, 16), generator=g)
    # uneven valid-token counts per sample: padding-style masked tails of different lengths
    for i, keep in enumerate([16, 3, 11, 16, 1, 8, 14, 5]):
        labels[i, keep:] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


def _grads(backend, plan, dtype=torch.float64):
    model = _model(dtype)
    loss_sum, tokens, _ = train_step(model, backend, _batch(), plan, CausalLM())
    return float(loss_sum / tokens), [p.grad.clone() for p in model.parameters()]


def test_gradient_is_split_invariant(backend):
    """fp32, as training runs: 8×1 and 2×4 agree to 1e-6 relative (summation order only)."""
    whole_loss, whole = _grads(backend, Plan(8, 1), torch.float32)
    split_loss, split = _grads(backend, Plan(2, 4), torch.float32)
    assert split_loss == pytest.approx(whole_loss, rel=1e-6)
    scale = max(g.abs().max().item() for g in whole)
    for a, b in zip(whole, split):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6 * scale)


def test_loss_is_mean_over_valid_tokens_of_global_batch(backend):
    """float64, so the check is about the math, not rounding. Not the mean of per-micro-batch means: a sample with 1 valid token weighs 1/85."""
    model = _model()
    batch = _batch()
    logits = model(input_ids=batch["input_ids"]).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    loss, grads = _grads(backend, Plan(2, 4))
    assert loss == pytest.approx(ref.item(), rel=1e-12)
    for a, b in zip(ref_grads, grads):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-12)


def test_lr_schedule_warmup_then_cosine():
    from memtrain.config import TrainingConfig

    f = lr_lambda(TrainingConfig(warmup_steps=4, max_steps=20, min_lr_ratio=0.1))
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(20) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 25))


def _speech_model():
    from transformers import WavLMConfig, WavLMForCTC

    torch.manual_seed(0)
    cfg = WavLMConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                      conv_dim=[8] * 7, feat_extract_norm="layer", do_stable_layer_norm=True,
                      num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, num_buckets=16,
                      hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                      final_dropout=0.0, mask_time_prob=0.0, layerdrop=0.0, pad_token_id=0)
    return WavLMForCTC(cfg).double().train()


def test_ctc_gradient_is_split_invariant(backend):
    """CTC summed per utterance and divided by the step's character count: one micro-batch of 8
    and four of 2 (each trimmed to its own longest utterance, so padded differently) agree."""
    g = torch.Generator().manual_seed(2)
    lengths = [9000, 8200, 7000, 6400, 5200, 4000, 3300, 2600]  # longest first, as SpeechDataset collates
    chars = [11, 9, 8, 7, 6, 5, 3, 2]
    batch = {"input_values": torch.zeros(8, 9000, dtype=torch.float64),
             "attention_mask": torch.zeros(8, 9000, dtype=torch.int64),
             "labels": torch.full((8, 11), IGNORE_INDEX, dtype=torch.int64)}
    for i, (n, c) in enumerate(zip(lengths, chars)):
        batch["input_values"][i, :n] = torch.randn(n, generator=g, dtype=torch.float64)
        batch["attention_mask"][i, :n] = 1
        batch["labels"][i, :c] = torch.randint(2, 40, (c,), generator=g)
    results = []
    for plan in (Plan(8, 1), Plan(2, 4)):
        model = _speech_model()
        loss_sum, count, _ = train_step(model, backend, batch, plan, CTC(model))
        assert float(count) == sum(chars)
        results.append((float(loss_sum / count), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (whole_loss, whole), (split_loss, split) = results
    assert split_loss == pytest.approx(whole_loss, rel=1e-9)
    assert len(whole) == len(split) > 0
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_resumed_schedule_takes_this_runs_max_steps():
    """A resume may change training.max_steps: the first resumed step already runs at the new
    schedule's rate (not the saved run's last one), and the schedule continues from there."""
    import torch

    from memtrain.config import TrainingConfig
    from memtrain.optim import lr_lambda, make_scheduler

    def scheduler(max_steps):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
        return opt, make_scheduler(opt, TrainingConfig(lr=1e-2, warmup_steps=2, max_steps=max_steps, min_lr_ratio=0.1))

    _, short = scheduler(6)
    for _ in range(4):
        short.step()
    opt, longer = scheduler(20)
    longer.load_state_dict(short.state_dict())
    expected = 1e-2 * lr_lambda(TrainingConfig(warmup_steps=2, max_steps=20, min_lr_ratio=0.1))(4)
    assert longer.get_last_lr() == [pytest.approx(expected)] and expected != pytest.approx(short.get_last_lr()[0])


def test_resuming_with_another_kind_of_schedule_is_refused():
    """A DeepSpeed JSON scheduler section added or dropped between runs: exit 4's error, not a
    schedule silently restarted at warmup."""
    import torch

    from memtrain.config import TrainingConfig
    from memtrain.errors import CheckpointError
    from memtrain.optim import make_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    ours = make_scheduler(opt, TrainingConfig())
    theirs = make_scheduler(opt, TrainingConfig(), {"type": "WarmupLR", "params": {"warmup_num_steps": 4}})
    with pytest.raises(CheckpointError, match="DeepSpeed JSON"):
        ours.load_state_dict(theirs.state_dict())
    with pytest.raises(CheckpointError, match="warmup \\+ cosine"):
        theirs.load_state_dict(ours.state_dict())


def test_adamw_is_fused_on_the_cpu_and_steps_like_the_reference():
    """The fused kernel (one for every tensor) is on for CPU float parameters and takes the same
    step as the per-tensor loop of torch's AdamW."""
    from memtrain.config import TrainingConfig
    from memtrain.optim import make_optimizer

    tcfg = TrainingConfig(lr=1e-2, weight_decay=0.1)
    models = [_model(torch.float32), _model(torch.float32)]
    fused = make_optimizer(models[0], tcfg)
    assert fused.defaults["fused"] is True
    reference = torch.optim.AdamW([{"params": [p for p in models[1].parameters() if p.ndim >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in models[1].parameters() if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(tcfg.adam_beta1, tcfg.adam_beta2), eps=tcfg.adam_eps, foreach=False)
    for _ in range(3):
        for model, opt in zip(models, (fused, reference)):
            model(input_ids=_batch()["input_ids"]).logits.square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
