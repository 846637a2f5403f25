"""FSDP2's optimizer offload (memtrain/backends/optimizer_offload.py) in one process: the same update as
torch's AdamW whatever share is on the host, the host step overlapping the next forward without a
forward ever reading a stale parameter, exact state round trips, and its host bytes against the
placement planner's accounting."""

import copy
import threading
import time

import pytest
import torch
from torch import nn

from memtrain.memory.accounting import fsdp_state_bytes
from memtrain.memory.shape import model_shape
from memtrain.backends.optimizer_offload import PartialOffloadAdamW, host_split
from memtrain.optim import weight_decay_groups

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 50)).to(dtype)


def offloaded(net, ratio, overlap=True, state_dtype="fp32"):
    base = torch.optim.AdamW(weight_decay_groups(net, 0.1), **HYPER)
    opt = PartialOffloadAdamW(base.param_groups, list(net.parameters()), ratio, state_dtype, overlap)
    opt.attach([net, *net])
    return opt


def train(net, opt, steps, seed=1):
    torch.manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 50, (4, 8))
        loss = net(x).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    return losses


@pytest.mark.parametrize("ratio,overlap", [(0.0, True), (0.5, True), (0.5, False), (1.0, True)])
def test_same_update_as_torch_adamw_whatever_share_is_on_the_host(ratio, overlap):
    """fp32 parameters: bitwise torch's fused AdamW (its groups' weight decay included), the
    forward after each step reading the updated parameters."""
    ref_net = model()
    ref = train(ref_net, torch.optim.AdamW(weight_decay_groups(ref_net, 0.1), **HYPER, fused=True), 6)
    net = model()
    opt = offloaded(net, ratio, overlap)
    assert train(net, opt, 6) == ref
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), ref_net.parameters()))
    assert len(opt.host_params) == {0.0: 0, 0.5: 2, 1.0: 5}[ratio]
    opt.close()


def test_16_bit_parameters_step_an_fp32_master():
    """bf16 parameters: the update is AdamW on an fp32 master (torch's, on an fp32 copy of the
    model), the parameters its rounding; a bf16 parameter stepped alone would lose the small updates."""
    net = model(torch.bfloat16)
    master_net = copy.deepcopy(net).float()  # the master starts from the bf16 weights, as DeepSpeed's does
    opt = offloaded(net, 0.5)
    ref_opt = torch.optim.AdamW(weight_decay_groups(master_net, 0.1), **HYPER, fused=True)
    torch.manual_seed(1)
    for _ in range(4):
        x = torch.randint(0, 50, (4, 8))
        net(x).float().logsumexp(-1).mean().backward()
        for p, q in zip(master_net.parameters(), net.parameters()):
            p.grad = q.grad.float()  # the same gradients into the fp32 reference
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    opt.synchronize()
    for p, q in zip(master_net.parameters(), net.parameters()):
        assert torch.equal(opt.state[q]["master"], p.detach())
        assert torch.equal(q.detach(), p.detach().to(torch.bfloat16))
    opt.close()


def test_the_next_forward_waits_for_a_slow_host_step(monkeypatch):
    """With the host step slowed down, step() returns before it finishes, and the forward that
    follows still computes with the updated parameters (each unit's pre-hook waits)."""
    net = model()
    opt = offloaded(net, 1.0)
    original = opt._step_one
    returned = threading.Event()

    def slow(p, grad, hyper, out=None):
        if out is not None:  # the host part, in the background thread
            returned.wait(5)
            time.sleep(0.05)
        original(p, grad, hyper, out)

    monkeypatch.setattr(opt, "_step_one", slow)
    x = torch.randint(0, 50, (4, 8))
    net(x).logsumexp(-1).mean().backward()
    opt.step()
    returned.set()
    assert not all(opt._ready[id(p)].is_set() for p in opt.host_params)  # still running: overlapped
    overlapped = net(x)
    opt.synchronize()
    assert torch.equal(overlapped, net(x))
    opt.close()


def test_a_failed_host_step_is_raised_not_waited_for(monkeypatch):
    """An error in the background thread reaches the next forward (its pre-hook), not a hang."""
    net = model()
    opt = offloaded(net, 0.5)
    original = opt._step_one

    def broken(p, grad, hyper, out=None):
        if out is not None:
            raise RuntimeError("host step failed")
        original(p, grad, hyper, out)

    monkeypatch.setattr(opt, "_step_one", broken)
    x = torch.randint(0, 50, (4, 8))
    net(x).logsumexp(-1).mean().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="host step failed"):
        net(x)
    opt.close()


def test_state_round_trip_is_exact_and_keeps_places_and_dtypes():
    """A saved state loaded into a new optimizer trains on bitwise like the original; the master
    stays fp32 beside bf16 parameters (torch's load would cast it to the parameter's dtype)."""
    net = model(torch.bfloat16)
    opt = offloaded(net, 0.5)
    train(net, opt, 3)
    saved_net, saved = copy.deepcopy(net), copy.deepcopy(opt.state_dict())
    after = train(net, opt, 3, seed=2)
    fresh = offloaded(saved_net, 0.5)
    fresh.load_state_dict(saved)
    assert all(fresh.state[p]["master"].dtype == torch.float32 for p in fresh.host_params)
    assert train(saved_net, fresh, 3, seed=2) == after
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), saved_net.parameters()))
    opt.close()
    fresh.close()


def test_host_split_takes_the_last_parameters_and_at_least_the_share():
    params = [torch.zeros(n) for n in (100, 10, 50, 40)]
    for ratio in (0.0, 0.2, 0.45, 0.5, 1.0):
        host = [p for p in params if id(p) in host_split(params, ratio)]
        share = sum(p.numel() for p in host) / 200
        assert share >= ratio - 1e-9 and (not host or share - host[0].numel() / 200 < ratio)
        assert host == params[len(params) - len(host):]


@pytest.mark.parametrize("dtype,state_dtype", [(torch.bfloat16, "fp32"), (torch.float32, "fp32"),
                                               (torch.bfloat16, "bf16")])
def test_host_and_device_bytes_match_the_accounting(dtype, state_dtype):
    """The tensors the optimizer holds on the host and on the device (counted from its state)
    against the placement planner's accounting for one rank (a model without repeated blocks):
    within 2%."""
    net = nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 256), nn.Linear(256, 512)).to(dtype)
    opt = offloaded(net, 0.6, state_dtype=state_dtype)
    held = opt.state_bytes()
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    shape = model_shape(net)
    predicted = fsdp_state_bytes(shape.parameters, precision, "optimizer", 1, shape, state_dtype, 0.6)
    host = predicted["offloaded_optimizer_bytes"] + predicted["offloaded_buffer_bytes"]
    assert held["host"] == pytest.approx(host, rel=0.02)
    assert held["device"] == pytest.approx(predicted["optimizer_bytes"], rel=0.02)
    opt.close()


def test_accumulating_micro_batches_hold_only_the_sharded_16_bit_gradients():
    """Under the optimizer offload every micro-batch reduce-scatters into the sharded gradients
    (FSDP2, one in-process rank, bf16): when the second micro-batch starts, every block's parameter
    already holds its sharded bf16 gradient and FSDP2 keeps no whole fp32 gradient (``unsharded_accumulated_grad``,
    4 bytes per parameter: 40 GB for the 10.2B Llama, which did not fit 80 GB at global batch 64).
    The accumulated gradients equal one micro-batch of the whole batch's within bf16's rounding."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import GPT2Config, GPT2LMHeadModel

    from memtrain.backends.fsdp import FSDPBackend, _param_groups
    from memtrain.distributed import ProcessState
    from memtrain.objectives import CausalLM
    from memtrain.plan import Plan
    from memtrain.step import train_step

    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 97, (4, 16), generator=g)}
    batch["labels"] = batch["input_ids"].clone()
    process = ProcessState(cpu=True)
    backend = FSDPBackend(process, "bf16", offload="optimizer", offload_optimizer_ratio=0.5)
    try:
        grads = {}
        for plan in (Plan(4, 1), Plan(2, 2)):
            torch.manual_seed(0)
            net = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).train()
            net, opt = backend.prepare(net, lambda m: torch.optim.AdamW(m.parameters(), **HYPER))
            seen = []

            def at_forward(module, args):
                held = [fp.unsharded_accumulated_grad for m in net.modules() if isinstance(m, FSDPModule)
                        for group in _param_groups(m._get_fsdp_state()) for fp in group.fsdp_params]
                blocks = [p.grad for block in net.transformer.h for p in block.parameters()]
                seen.append((all(t is None for t in held), blocks))

            hook = net.register_forward_pre_hook(at_forward)
            train_step(net, backend, batch, plan, CausalLM())
            hook.remove()
            grads[plan.gradient_accumulation_steps] = [p.grad.full_tensor().float() for p in net.parameters()]
            opt.close()
            backend.offload_optimizer = None
        no_whole_gradient, second = seen[1]  # the second micro-batch's forward
        assert no_whole_gradient
        assert all(g is not None and g.dtype == torch.bfloat16 for g in second)
        for a, b in zip(grads[2], grads[1]):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))
    finally:
        backend.close()
        process.close()
