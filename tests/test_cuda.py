"""The paths only a GPU runs: a real CUDA out-of-memory error recovered, bf16 chosen by
``precision auto``. Marked ``cuda``; skipped (with the reason) without a CUDA device.
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

    from memtrain.activation_offload import enable_activation_offload, moved_bytes

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
