"""The paths only a GPU runs: a real CUDA out-of-memory error recovered, bf16 chosen by
``precision auto``, activation offload's copies, FSDP2's optimizer offload on CUDA streams. Marked ``cuda``; skipped (with the reason) without a CUDA device.
``python benchmarks/gpu_suite.py`` runs these first whenever a GPU is at hand."""

import pytest
import torch

from conftest import tiny_args

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
WIDE = ["--model.config.n_embd", "256", "--model.config.n_head", "4", "--model.config.n_layer", "4",
        "--data.seq_len", "32", "--training.global_batch_size", "64"]


def test_a_real_cuda_oom_is_recovered_and_trains_like_the_plan_it_lands_on(tmp_path, cache_dir):
    """One rank under ``memory.cuda_memory_cap_gib`` set between the predicted tensor peaks of
    micro-batch 16 and 64 (the planned peaks less the allocator's headroom, whose fixed 512 MiB
    would put the cap above both on this small model: measured on an H200, no OOM then): the run
    starting at 64 runs out of CUDA memory, every retry keeps the samples, and its losses equal
    (1e-5) a run started at the plan it ended on."""
    from memtrain.config import parse_args
    from memtrain.memory.accounting import without_allocator_headroom
    from memtrain.estimate import plan_report
    from memtrain.train import main

    base = tiny_args(tmp_path / "x", cache_dir, "--training.max_steps", "4", *WIDE)
    report = plan_report(parse_args(base), 1)
    peak = {c["micro_batch_size"]: without_allocator_headroom(c["predicted_peak_bytes"], "cuda")
            for c in report["candidates"] if c["activation_checkpointing"] == "off"}
    cap_gib = (peak[16] + peak[64]) / 2 / 2**30 + torch.cuda.memory_reserved() / 2**30
    recovered = main(tiny_args(tmp_path / "oom", cache_dir, "--training.max_steps", "4", *WIDE,
                               "--training.micro_batch_size", "64", "--memory.cuda_memory_cap_gib", str(cap_gib))).records
    assert any(r.get("event") == "oom_shrink" for r in recovered)
    final = recovered[-1]["micro_batch_size"]
    assert final < 64
    static = main(tiny_args(tmp_path / "static", cache_dir, "--training.max_steps", "4", *WIDE,
                            "--training.micro_batch_size", str(final))).records
    for r, s in zip(recovered, static):
        assert r["batch_fingerprint"] == s["batch_fingerprint"]
        assert r["loss"] == pytest.approx(s["loss"], rel=1e-5)


def test_precision_auto_trains_in_bf16_where_the_gpu_has_it(tmp_path, cache_dir):
    """``precision auto`` on a GPU of compute capability ≥ 8.0 trains in bf16 (finite, falling
    losses); below 8.0, in fp32 (never fp16)."""
    from memtrain.train import main

    args = tiny_args(tmp_path, cache_dir, "--training.max_steps", "6", "--training.lr", "3e-3")
    args[args.index("--precision") + 1] = "auto"
    result = main(args)
    expected = "bf16" if torch.cuda.get_device_capability()[0] >= 8 else "fp32"
    assert result.summary["precision"] == expected
    losses = [r["loss"] for r in result.records]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_activation_offload_on_cuda_keeps_the_gradients_and_lowers_the_peak():
    """``memory.activation_offload`` on a GPU (pinned host copies on a side stream): a GPT-2 micro-step
    with dropout has the loss and every gradient of the same step without it (bitwise: the copies
    are exact), and ``max_memory_allocated`` above the model state drops, the bytes moved being
    most of what it held before."""
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    from memtrain.levers.activation_offload import enable_activation_offload, moved_bytes

    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=256, vocab_size=512,
                                     bos_token_id=0, eos_token_id=0)).cuda().train()
    ids = torch.randint(0, 512, (8, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    results = {}
    for offload in (False, True):
        probe = copy.deepcopy(net)
        if offload:
            enable_activation_offload(probe)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.manual_seed(2)
        loss = probe(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        results[offload] = (loss.detach(), [p.grad for p in probe.parameters()],
                            torch.cuda.max_memory_allocated() - base, moved_bytes(probe))
    (l0, g0, peak0, _), (l1, g1, peak1, moved) = results[False], results[True]
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert peak1 < peak0 and moved > (peak0 - peak1)


# FSDP2's optimizer offload (memtrain/backends/optimizer_offload.py) on CUDA streams: what only a GPU's
# asynchronous copies can get wrong. Each test names the synchronisation it checks and what fails
# without it.
N_BIG = 1 << 25  # 32M fp32 elements (128 MiB): copies long enough for a missing wait to be seen


def _reference_adamw(values: torch.Tensor, grad: torch.Tensor, steps: int = 1, **hyper) -> torch.Tensor:
    """torch's own AdamW (fused CPU kernel) on an fp32 host copy: the update computed apart."""
    master = torch.nn.Parameter(values.detach().float().cpu().clone())
    opt = torch.optim.AdamW([master], fused=True, **hyper)
    for _ in range(steps):
        master.grad = grad.detach().float().cpu().clone()
        opt.step()
    return master.detach()


HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _offload(params, ratio=1.0, overlap=True):
    from memtrain.backends.optimizer_offload import PartialOffloadAdamW

    return PartialOffloadAdamW([{"params": list(params), **HYPER}], list(params), ratio, overlap=overlap)


class _Reader(torch.nn.Module):
    """A unit whose forward reads its parameter on the default stream right away (as FSDP's gather would)."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self):
        return self.p.detach().clone()


def test_offload_on_cuda_a_forward_never_reads_a_parameter_before_its_copy_back_completed(monkeypatch):
    """The host step slowed and the parameter's copy back long (128 MiB over PCIe): the unit's
    forward, run as soon as ``step()`` returns, reads exactly the AdamW update computed apart.
    Fails when the parameter is marked ready once its copy is issued instead of completed (the
    ``done.synchronize()`` before ``_ready[...].set()`` in ``_host_steps``): the default stream's
    read is not ordered after the side stream's copy."""
    import time

    from memtrain import offload_optimizer

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N_BIG, device="cuda"))
    grad = torch.randn(N_BIG, device="cuda")
    expected = _reference_adamw(p, grad, **HYPER)
    chunk = offload_optimizer._adamw_chunk

    def slow(*args, **kwargs):
        time.sleep(0.002)  # the host step takes long: the forward is waiting when it finishes
        return chunk(*args, **kwargs)

    monkeypatch.setattr(offload_optimizer, "_adamw_chunk", slow)
    reader = _Reader(p)
    opt = _offload([p])
    opt.attach([reader])
    p.grad = grad
    opt.step()
    seen = reader()  # waits for the unit's parameters, then reads on the default stream
    torch.cuda.synchronize()
    opt.close()
    assert torch.equal(seen.cpu(), expected)


def test_offload_on_cuda_the_host_step_never_reads_a_gradient_before_its_copy_completed():
    """The gradient is written by a kernel queued behind a long one (``torch.cuda._sleep``), so its
    copy into the pinned host buffer lands late: the update still equals AdamW computed apart from
    the finished gradient. Fails without the wait for the copies' event (``copied.synchronize()``
    at the start of ``_host_steps``): the thread would step whatever the buffer held."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N_BIG, device="cuda"))
    source = torch.randn(N_BIG, device="cuda")
    torch.cuda.synchronize()
    expected = _reference_adamw(p, source * 2, **HYPER)
    opt = _offload([p], overlap=False)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the gradient's kernel
    p.grad = source * 2  # queued behind the sleep: not written when step() issues the copy
    opt.step()
    opt.close()
    assert torch.equal(p.detach().cpu(), expected)


def test_offload_on_cuda_equals_adamw_on_fp32_masters_at_every_share():
    """Two steps of a bf16 model whose optimizer state is split (half of the parameters on the
    host, stepped by torch's fused CPU AdamW; the rest on the GPU, its fused CUDA AdamW): every
    fp32 master equals AdamW on fp32 masters computed apart on the CPU — the host part bitwise (the
    same CPU kernel), the device part within rtol 1e-6 / atol 1e-7 (the CUDA and CPU fused kernels
    may round the moments' square root and division differently in the last bit)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1000 + 37 * i, device="cuda").bfloat16()) for i in range(6)]
    grads = [[torch.randn(p.shape, device="cuda").bfloat16() for p in params] for _ in range(2)]
    masters = [p.detach().float().cpu() for p in params]
    opt = _offload(params, ratio=0.5, overlap=False)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()
    on_host = {id(p) for p in opt.host_params}
    assert 0 < len(on_host) < len(params)
    for p, master, (g1, g2) in zip(params, masters, zip(*grads)):
        ref = torch.nn.Parameter(master.clone())
        ref_opt = torch.optim.AdamW([ref], fused=True, **HYPER)
        for g in (g1, g2):
            ref.grad = g.float().cpu()
            ref_opt.step()
        got = opt.state[p]["master"].cpu()
        if id(p) in on_host:
            assert torch.equal(got, ref.detach())
        else:
            torch.testing.assert_close(got, ref.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach().cpu(), got.bfloat16())  # the parameter is its master, rounded
    opt.close()


def test_offload_on_cuda_a_run_killed_mid_step_resumes_to_the_same_losses(tmp_path, cache_dir):
    """One rank on the GPU, FSDP2 with half of the optimizer state on the host (overlapped: the
    default on a GPU), killed inside step 5 and resumed from its step-4 checkpoint: steps 5–8 have
    the uninterrupted run's samples and losses (rel 1e-6: the same kernels on the same GPU)."""
    import subprocess
    import sys

    from conftest import ENGINES, REPO, read_metrics

    def run(out, *extra):
        args = tiny_args(out, cache_dir, "--training.max_steps", "8", "--checkpoint.every_steps", "4",
                         *ENGINES["fsdp_offload_optimizer"], "--precision", "bf16", *extra)
        return subprocess.run([sys.executable, str(REPO / "memtrain" / "train.py"), *args], capture_output=True,
                              text=True, timeout=600)

    def records(out):
        return [r for r in read_metrics(out) if "loss" in r and "step" in r]

    assert run(tmp_path / "straight").returncode == 0
    kill = ["--faults.kill_at_step", "5", "--faults.kill_mid_step", "true"]
    assert run(tmp_path / "killed", *kill).returncode != 0
    resumed = run(tmp_path / "killed", *kill)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    base, after = records(tmp_path / "straight"), records(tmp_path / "killed")
    assert [r["step"] for r in after] == list(range(1, 9))
    for r, b in zip(after[4:], base[4:]):
        assert r["batch_fingerprint"] == b["batch_fingerprint"]
        assert r["loss"] == pytest.approx(b["loss"], rel=1e-6)
