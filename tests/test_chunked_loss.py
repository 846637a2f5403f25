"""Chunked cross-entropy (memory.chunked_cross_entropy): the output layer computes the loss a chunk
of tokens at a time, so the [tokens, vocab] logits are never saved for backward."""

import pytest
import torch

from conftest import TINY_ARGS
from memtrain.config import ConfigError


def _gpt2(vocab: int = 1024):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=vocab, n_positions=64, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).float()


class _Text:
    kind = "text"


def _saved_bytes_and_grads(model, objective, batch):
    from memtrain.memory.simulated import SimulatedMemory

    counter = SimulatedMemory(2**62, 0, model.parameters())
    with counter.context():
        loss = objective.loss_sum(model, batch)
    loss.backward()
    return loss.detach(), counter.peak_bytes, [p.grad for p in model.parameters()]


def test_gradient_equals_the_plain_loss_and_logits_are_not_saved():
    """Same loss and gradients as F.cross_entropy on the full logits (within 1e-5), with less saved
    for backward; the model still returns plain logits outside the objective."""
    from memtrain.levers import LeverTarget, lever
    from memtrain.objectives import CausalLM, make_objective

    plain_model, chunked_model = _gpt2(), _gpt2()
    ids = torch.randint(0, 1024, (8, 64), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    batch = {"input_ids": ids, "labels": labels}
    loss_p, bytes_p, grads_p = _saved_bytes_and_grads(plain_model, CausalLM(), batch)
    objective = make_objective(chunked_model, _Text())
    lever("chunked_cross_entropy").apply(LeverTarget(chunked_model, [], objective, None), True)
    loss_c, bytes_c, grads_c = _saved_bytes_and_grads(chunked_model, objective, batch)
    assert objective.chunked
    assert float(loss_c) == pytest.approx(float(loss_p), rel=1e-6)
    for gp, gc in zip(grads_p, grads_c):
        assert (gp - gc).abs().max() <= 1e-5 * gp.abs().max()
    logits_bytes = 8 * 64 * 1024 * 4
    assert bytes_p - bytes_c >= logits_bytes  # at least the fp32 logits are no longer kept
    with torch.no_grad():  # outside the objective: the ordinary logits
        assert torch.equal(chunked_model(input_ids=ids).logits, plain_model(input_ids=ids).logits)


def test_chunks_cover_every_token_once():
    from memtrain.levers.chunked_cross_entropy import chunk_tokens, chunked_cross_entropy_sum

    assert chunk_tokens(50304) == 333 and chunk_tokens(8192, max_bytes=2**20) == 32  # fp32 logits per chunk
    hidden = torch.randn(3, 7, 16, dtype=torch.float64)
    weight, bias = torch.randn(40, 16, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
    labels = torch.randint(0, 40, (3, 7))
    labels[0, 2] = -100
    plain = torch.nn.functional.cross_entropy((hidden @ weight.T + bias).flatten(0, 1), labels.flatten(),
                                              ignore_index=-100, reduction="sum")
    for chunk in (1, 4, 21, 64):  # uneven last chunk, one chunk
        assert float(chunked_cross_entropy_sum(hidden, weight, bias, labels, chunk)) == pytest.approx(float(plain), rel=1e-12)


def test_planner_counts_it_as_a_memory_lever(cache_dir, monkeypatch):
    """The planner's fake trace applies the lever per plan: fewer bytes per micro-batch with the
    chunked loss (so a larger micro-batch is predicted to fit the same budget), and the plain count
    again when a plan switches it off. The step's peak drops once the logits span several chunks
    (chunks of 32 tokens here; at the default 64 MiB a chunk holds all of the tiny model's
    logits, so only what autograd saves drops: the simulated device's count)."""
    import memtrain.levers.chunked_cross_entropy
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import build_model
    from memtrain.objectives import make_objective
    from memtrain.planning.activations import activation_table
    from memtrain.plan import Plan

    cfg = parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir])
    corpus = build_corpus(cfg.data)
    objective = make_objective(build_model(cfg.model, corpus.vocab_size), corpus)
    simulated = parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir, "--faults.memory_budget_mib", "64"])
    logits_bytes = 4 * cfg.data.seq_len * corpus.vocab_size * 4
    for config in (simulated, cfg):
        if config is cfg:
            monkeypatch.setattr(memtrain.levers.chunked_cross_entropy, "chunk_tokens", lambda vocab_size, max_bytes=0: 32)
        traced = activation_table(config, corpus, objective, "fp32", "cpu")

        def acts(chunked: bool, ac: bool) -> int:
            return traced(Plan(4, 1, (("activation_checkpointing", ac), ("chunked_cross_entropy", chunked))))

        plain = acts(False, False)
        assert plain - acts(True, False) >= logits_bytes
        assert acts(True, True) < acts(False, True)
        assert traced(Plan(2, 2, (("activation_checkpointing", False), ("chunked_cross_entropy", False)))) < plain
    assert not objective.chunked  # the run's objective is not the one traced


def test_unsupported_model_is_refused_by_name():
    """A model whose logits are not a plain linear output layer, or a CTC model: refused naming the field."""
    from types import SimpleNamespace

    from memtrain.levers import LeverTarget, lever
    from memtrain.objectives import make_objective
    from toy_models import make

    model = make(64, dim=8)
    with pytest.raises(ConfigError) as info:
        lever("chunked_cross_entropy").apply(LeverTarget(model, [], make_objective(model, _Text()), None), True)
    assert info.value.field == "memory.chunked_cross_entropy" and "TinyLM" in str(info.value)

    speech = SimpleNamespace(memory=SimpleNamespace(chunked_cross_entropy=True), data=SimpleNamespace(kind="speech"))
    with pytest.raises(ConfigError) as info:
        lever("chunked_cross_entropy").choices(speech, None)
    assert info.value.field == "memory.chunked_cross_entropy"
