"""optimizer.state_dtype: AdamW's moments in fp32, bf16 or torchao's int8, checked against torch's
own AdamW (the update), the state tensors' own sizes (the accounting) and a save/load round trip
(resume). The 2-rank runs are in test_backends (test_lossy_optimizer_state_*)."""

from __future__ import annotations

import copy
import io
from types import SimpleNamespace

import pytest
import torch

from memtrain.errors import ConfigError
from memtrain.memory.accounting import adam_state_bytes
from memtrain.optim import make_optimizer, make_scheduler

HYPER = SimpleNamespace(lr=1e-2, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1,
                        warmup_steps=3, max_steps=20, min_lr_ratio=0.1)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.GELU(), torch.nn.Linear(128, 64))


def _train(model, optimizer, steps: int, start: int = 0, scheduler=None) -> None:
    for i in range(start, start + steps):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _state_bytes(optimizer) -> int:
    """Bytes of the moments as the tensors hold them (a tensor subclass: its inner tensors)."""
    def nbytes(t) -> int:
        if type(t) is torch.Tensor:
            return t.numel() * t.element_size()
        names, _ = t.__tensor_flatten__()
        return sum(nbytes(getattr(t, name)) for name in names)
    return sum(nbytes(s[k]) for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_lossy_states_follow_torch_adamw_in_the_bytes_the_accounting_predicts(dtype):
    """The update stays torch's AdamW's (after 20 steps of a warmup + cosine schedule, which must
    keep driving the optimizer, the parameters differ by under 5% of how far torch's moved them)
    while the moments take the bytes adam_state_bytes predicts: counted from the tensors, half of
    fp32's for bf16."""
    if dtype == "int8":
        pytest.importorskip("torchao.optim")
    start, reference, lossy = _model(), _model(), _model()
    opt = make_optimizer(lossy, HYPER, dtype)
    ref_opt = make_optimizer(reference, HYPER)  # torch's fused AdamW, the same decay groups
    _train(reference, ref_opt, 20, scheduler=make_scheduler(ref_opt, HYPER))
    _train(lossy, opt, 20, scheduler=make_scheduler(opt, HYPER))
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-6)
    assert float(opt.param_groups[0]["lr"]) < HYPER.lr / 2  # the cosine decay reached the optimizer
    norm = lambda pairs: sum(((a - b) ** 2).sum() for a, b in pairs).item() ** 0.5  # noqa: E731
    moved = norm(zip(reference.parameters(), start.parameters()))
    assert norm(zip(reference.parameters(), lossy.parameters())) < 0.05 * moved  # bf16: 0.2%, int8: 1.9%
    assert any(not torch.equal(a, b) for a, b in zip(reference.parameters(), lossy.parameters()))  # rounded: lossy
    numels = [p.numel() for p in lossy.parameters()]
    assert _state_bytes(ref_opt) == adam_state_bytes("fp32", numels)
    assert _state_bytes(opt) == adam_state_bytes(dtype, numels)
    if dtype == "bf16":
        assert _state_bytes(opt) * 2 == _state_bytes(ref_opt)
    else:
        assert _state_bytes(opt) < 0.5 * _state_bytes(ref_opt)  # the two 8192-element matrices are int8


def test_bf16_states_step_exactly_like_torch_adamw_before_rounding(monkeypatch):
    """The first step reads moments of zero, so only the stored moments are rounded: the
    parameters equal torch's AdamW's to float rounding, with the update done in chunks (a chunk
    of 1000 elements splits the 8192-element matrices) and with a tensor learning rate."""
    import memtrain.optim as optim

    monkeypatch.setattr(optim, "BF16_STEP_CHUNK", 1000)
    reference, bf16 = _model(), _model()
    ref_opt = torch.optim.AdamW(weight_decay_groups(reference), lr=HYPER.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    opt = make_optimizer(bf16, HYPER, "bf16")
    opt.param_groups[0]["lr"] = torch.tensor(HYPER.lr)
    _train(reference, ref_opt, 1)
    _train(bf16, opt, 1)
    for a, b in zip(reference.parameters(), bf16.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())


def weight_decay_groups(model):
    from memtrain.optim import weight_decay_groups as groups

    return groups(model, HYPER.weight_decay)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_lossy_states_resume_bitwise_through_a_weights_only_checkpoint(dtype):
    """Ten steps straight = five, torch.save/torch.load(weights_only=True) of the optimizer state
    (as memtrain's DDP checkpoint does), five more; the moments keep their dtype."""
    if dtype == "int8":
        pytest.importorskip("torchao.optim")
    straight, resumed = _model(), _model()
    opt = make_optimizer(straight, HYPER, dtype)
    _train(straight, opt, 10)
    first = make_optimizer(resumed, HYPER, dtype)
    _train(resumed, first, 5)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    again = make_optimizer(resumed, HYPER, dtype)
    again.load_state_dict(torch.load(buffer, weights_only=True))
    _train(resumed, again, 5, start=5)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    moments = [s["exp_avg"] for s in again.state.values()]
    if dtype == "bf16":
        assert all(m.dtype == torch.bfloat16 for m in moments)
    else:
        assert any(type(m).__name__ == "OptimState8bit" for m in moments)


def test_lossy_states_are_refused_under_deepspeed():
    from memtrain.levers import lever

    cfg = SimpleNamespace(optimizer=SimpleNamespace(state_dtype="bf16"))
    zero2 = SimpleNamespace(name="deepspeed", zero_stage=2, deepspeed_config=None)
    with pytest.raises(ConfigError, match="'optimizer.state_dtype'.*ddp and fsdp"):
        lever("optimizer_state_dtype").choices(cfg, zero2)
    assert lever("optimizer_state_dtype").choices(cfg, SimpleNamespace(name="fsdp")) == ("bf16",)


def test_int8_without_torchao_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match="'optimizer.state_dtype'.*memtrain\\[lowbit\\]"):
        make_optimizer(copy.deepcopy(_model()), HYPER, "int8")
