"""The simulated device memory (faults.memory_budget_mib), in process: it raises a real OOM only
when the counted bytes pass the budget, frees what backward releases, and activation
checkpointing lowers the count because less is saved."""

import gc

import pytest
import torch

from memtrain.levers.activation_checkpointing import enable_activation_checkpointing
from memtrain.models import repeated_blocks
from memtrain.memory.simulated import SimulatedMemory


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=4, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).train()


def _forward(model, memory):
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(1))
    with memory.context():
        return model(input_ids=ids).logits.float().square().mean()


def test_counts_saved_bytes_and_releases_them_after_backward():
    """A chain whose saved tensors are known from autograd's rules: each ``tanh`` saves its
    output, multiplying by a Python number saves nothing, and the weight is a parameter (model
    state, not counted). The count equals that sum, and backward releases it."""
    layers, rows, width = 6, 8, 64
    weight = torch.nn.Parameter(torch.randn(width, width))
    memory = SimulatedMemory(2**40, 1000, [weight])
    x = torch.randn(rows, width)
    with memory.context():
        h = x @ weight  # saves x (an input, not a parameter: counted) and the weight (a parameter)
        for _ in range(layers):
            h = torch.tanh(h * 2.0)
        loss = h.sum()
    saved = memory.saved_bytes
    assert saved == (1 + layers) * rows * width * 4  # x, then one [rows, width] fp32 output per tanh
    assert memory.peak_bytes == 1000 + saved
    loss.backward()
    del loss, h
    gc.collect()
    assert memory.saved_bytes == 0 and memory.peak_bytes == 1000 + saved


def test_raises_out_of_memory_only_past_the_budget():
    model = _model()
    need = SimulatedMemory(2**40, 1000, model.parameters())
    _forward(model, need)
    exact = need.peak_bytes
    _forward(model, SimulatedMemory(exact, 1000, model.parameters()))  # fits exactly
    tight = SimulatedMemory(exact - 1, 1000, model.parameters())
    with pytest.raises(torch.OutOfMemoryError, match="simulated device"):
        _forward(model, tight)
    assert tight.saved_bytes == 0  # the failed forward's saved tensors are released (a retry starts empty)


def test_activation_checkpointing_lowers_the_count():
    model = _model()
    off = SimulatedMemory(2**40, 0, model.parameters())
    _forward(model, off)
    enable_activation_checkpointing(model, repeated_blocks(model), 1)
    on = SimulatedMemory(2**40, 0, model.parameters())
    _forward(model, on)
    assert on.peak_bytes < off.peak_bytes / 2


def test_a_parameter_storage_freed_during_forward_does_not_hide_an_activation():
    """ZeRO-3 and FSDP2 free a gathered parameter's storage mid-forward; an activation created
    next may get the freed storage's address and must still be counted (a stale address once
    made the logits of every other step pass for a parameter)."""
    layers, width, rows = 16, 64, 8
    for _ in range(20):  # the address is reused on some tries, not all
        weight = torch.nn.Parameter(torch.randn(width, width))
        memory = SimulatedMemory(10**9, 0, [weight])
        x = torch.randn(rows, width, requires_grad=True)
        with memory.context():
            weight.data = torch.empty(0)  # released, as a sharding engine does after the block
            h = x
            for _ in range(layers):
                h = torch.tanh(h * 1.0)  # each tanh saves its output: a new storage
            peak_expected = layers * h.untyped_storage().nbytes()
            h.sum().backward()
        assert memory.peak_bytes >= peak_expected
