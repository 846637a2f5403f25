"""The placement planner (memtrain/planning/placement.py): where model state lives for a model and a machine,
planned without a GPU; the partial-offload glue; a placement the host cannot hold is refused."""

import dataclasses
import json

import pytest

from conftest import REPO, run_cli, tiny_args
from memtrain.backends import model_state_bytes
from memtrain.memory.accounting import device_state_bytes
from memtrain.memory.shape import ModelShape
from memtrain.memory.machine import Machine
from memtrain.planning.placement import RATIO_STEP, Placement, plan_placements, variants
from memtrain.planning.planner import Candidate
from memtrain.plan import Plan

GIB = 2**30
N = 6_700_000_000
SHAPE = ModelShape(N, largest_block=N // 32, largest_module=N // 96)  # 32 blocks; a block's MLP matrix


def machine(device_gib=80, host_gib=128, ranks=1, nvme=None):
    return Machine(int(device_gib * GIB), int(host_gib * GIB), ranks, "cuda", 400e12, 1e9, 4 * GIB, nvme)


def candidates(activation_gib_per_sample=1.0, per_rank=16):
    out = []
    for micro in (16, 8, 4, 2, 1):
        c = Candidate(Plan(micro, per_rank // micro, (("activation_checkpointing", False),)), 0,
                      int(activation_gib_per_sample * micro * GIB))
        c.predicted_step_s = 6 * N * 1024 * per_rank / 400e12 + 1e-3 * (per_rank // micro)
        out.append(c)
    return out


def test_partial_offload_moves_exactly_the_ratio_of_the_optimizer_state():
    """ZeRO-3 keeps an fp32 gradient beside every optimizer sub-group, where the sub-group steps, and
    a 16-bit gradient buffer on the host (DeepSpeed's stage3.py)."""
    full = model_state_bytes("deepspeed", N, "bf16", 3, "none", 1)
    half = model_state_bytes("deepspeed", N, "bf16", 3, "optimizer", 1, offload_optimizer_ratio=0.5)
    assert half["optimizer_bytes"] == pytest.approx(full["optimizer_bytes"] / 2, rel=1e-9)
    assert half["gradient_bytes"] == 4 * N // 2
    assert half["cpu_offloaded_bytes"] == full["optimizer_bytes"] // 2 + 2 * N + 4 * N // 2
    nvme = model_state_bytes("deepspeed", N, "bf16", 3, "optimizer_and_params", 1, offload_device="nvme", shape=SHAPE)
    # only DeepSpeed's buffers stay on the device, in bf16: the reduce bucket (DeepSpeed's default
    # 5e8 elements) and reduce_scatter_coalesced's copy of it while it is reduced in backward (the
    # model is larger than one bucket), and the gathered parameters (one module, DeepSpeed's default
    # prefetch of 5e7 elements and up to its default reuse distance of 1e9 elements kept gathered)
    assert device_state_bytes(nvme) == nvme["buffer_bytes"] == 2 * 2 * 500_000_000 + 2 * (N // 96 + 5 * 10**7 + 10**9)
    assert nvme["backward_buffer_bytes"] == 2 * 500_000_000
    assert nvme["nvme_offloaded_bytes"] == (12 + 4) * N + 2 * N
    stage1 = model_state_bytes("deepspeed", N, "bf16", 1, "optimizer", 2)
    assert stage1["gradient_bytes"] == 2 * N  # whole 16-bit grads
    # fp32 gradient partition, master and moments, and the 16-bit staging copy of the partition
    assert stage1["cpu_offloaded_bytes"] == 16 * N // 2 + 2 * N // 2


def test_zero3_reduce_copy_and_one_rank_views_follow_deepspeed():
    """ZeRO-3's terms DeepSpeed's code and MemTracker showed (the families' rows, a 1.3M-parameter
    Mistral): reduce_scatter_coalesced's copy of the one bucket is 4 bytes per fp32 parameter at the
    end of backward, gone with a JSON's ``"reduce_scatter": false`` (the peak fell by exactly that)
    and back without ``contiguous_gradients``; on one rank nothing is gathered or kept whole twice
    (parameters are views of their partitions), except under parameter offload, where the
    partitions are on the host and the persistent ones stay on the device."""
    n = 1_308_000
    shape = ModelShape(n, largest_block=n // 4, largest_module=n // 12, numels=(n // 2, 50_000, n - n // 2 - 50_000))
    state = lambda world, offload="none", **json: model_state_bytes(  # noqa: E731
        "deepspeed", n, "fp32", 3, offload, world, shape=shape, zero_settings=json or None)
    default, in_place = state(2), state(2, reduce_scatter=0)
    assert default["step_gradient_bytes"] - in_place["step_gradient_bytes"] == 4 * n
    assert state(2, reduce_scatter=0, contiguous_gradients=0)["step_gradient_bytes"] == default["step_gradient_bytes"]
    assert default["gathered_parameter_bytes"] > 0 and default["parameter_bytes"] == 4 * n // 2 + 4 * 50_000
    alone = state(1)
    assert alone["gathered_parameter_bytes"] == 0 and alone["parameter_bytes"] == 4 * n
    offloaded = state(1, "optimizer_and_params")
    assert offloaded["gathered_parameter_bytes"] > 0 and offloaded["parameter_bytes"] == 4 * 50_000


def test_zero3_gathered_parameters_at_each_moment_of_the_step():
    """What ZeRO-3 holds gathered beyond its blocks, from DeepSpeed's code and MemTracker (the
    families' rows, seed 1, 2 ranks): a saved view keeps a released parameter's gathered buffer
    (``free_param`` points the parameter at an empty tensor; a Mixtral's fused experts were 5.5%
    under at AC off without it), so the micro-step's moments take the trace's kept peaks, capped
    in a block at every gathered parameter; at the optimizer step nothing is gathered but the first
    module's parameters (the input embeddings, reused at once by the next forward: Mistral's and
    GPT-NeoX's AC-on rows were 2-3% under without them, and GPT-2 small's 86M-parameter row 18%
    over with every gathered parameter counted there). Expected bytes from the shapes."""
    from memtrain.memory.peak import peak_tensor_bytes, peak_terms, plan_terms

    n, embedding = 1_000_000, 200_000
    shape = ModelShape(n, largest_block=n // 4, largest_module=embedding, numels=(embedding, 50_000, n - embedding - 50_000),
                       first_module_numels=(embedding,))
    two, alone = (model_state_bytes("deepspeed", n, "fp32", 3, "none", w, shape=shape) for w in (2, 1))
    assert two["view_kept_bytes"] == 4 * (n - 50_000) and two["step_gathered_bytes"] == 4 * embedding
    assert alone["view_kept_bytes"] == alone["step_gathered_bytes"] == 0  # views of the partitions
    small_first = dataclasses.replace(shape, first_module_numels=(50_000,))  # persistent: whole anyway
    assert model_state_bytes("deepspeed", n, "fp32", 3, "none", 2, shape=small_first)["step_gathered_bytes"] == 0
    terms = plan_terms(peak_terms(two), accumulating=True)
    assert terms["step"] == two["step_gradient_bytes"] + 4 * embedding and terms["kept"] == two["view_kept_bytes"]
    state, block = device_state_bytes(two), two["block_buffer_bytes"]
    # a small micro-step: the step moment, without the gathered blocks
    assert peak_tensor_bytes(state, (10, 10, 10), **terms) == state - block + terms["step"]
    # a large one: the kept peak outside the blocks, and inside them the cap on gathered bytes
    big, small = 10 * state, state
    assert peak_tensor_bytes(state, (big, small, small, 0, (big + 7, small, small)), **terms) == state - block + big + 7
    inside = peak_tensor_bytes(state, (small, big, small, 0, (small, big + 2 * terms["kept"], small)), **terms)
    assert inside == state - block + big + terms["kept"]  # views and blocks: never more than every gathered one
    wide = {**terms, "kept": 10 * block}  # more gathered in all than a block's: views and block add
    assert peak_tensor_bytes(state, (small, big, small, 0, (small, big + 5, small)), **wide) == (
        state - block + big + 5 + block)
    assert peak_tensor_bytes(state, (big, small, small, 0, (big + 7, small, small)), **{**terms, "kept": 0}) == (
        state - block + big)  # another engine: the kept peaks are not read
    # forward: the coalesced prefetch buffer (up to every gathered parameter) beside the copies not
    # yet released, never more copies than every gathered parameter
    forward = peak_tensor_bytes(state, (small, small, small, 0, (small, small, small, small + 5), None, small), **terms)
    assert forward == state - block + block + small + 5
    assert peak_tensor_bytes(state, (small, small, small, 0, (small, small, small, big), None, small), **terms) == (
        state - block + block + small + terms["kept"])
    # a large model's: the copies not yet released are never more than the gathered bytes
    wide_forward = peak_tensor_bytes(state, (small, small, small, 0, (small, small, small, big), None, small), **wide)
    assert wide_forward == state - block + block + small + block


def test_fsdp2_holds_the_reduce_scatter_of_the_block_before_while_a_block_runs_backward():
    """FSDP2 reduce-scatters a block's gradients in fp32 (``reduce_dtype``) after its backward and
    holds that input until the next block's reduce-scatter: MemTracker at the peak of a 2-rank bf16
    Mistral with AC on (seed 1) finds a 4-bytes-per-parameter buffer of one block beside the
    gathered blocks (6.0% under without it). It is counted beside the trace's peak while a block
    runs its backward after another one's ended (``StepPeaks.in_block_backward``), on one rank
    too, where torch copies the input into the shard instead of reducing it (MemTracker, fp32
    Qwen2 with AC on, 1 rank: that buffer at the peak), and where one block is gathered, not two:
    nothing is prefetched there (10.0% over with two); not at the forward's moments. Expected
    bytes from the shapes."""
    from memtrain.memory.peak import peak_tensor_bytes, peak_terms, plan_terms

    n, block = 1_000_000, 200_000
    shape = ModelShape(n, largest_block=block, largest_module=block // 4, root=100_000)
    two, alone = (model_state_bytes("fsdp", n, "bf16", None, "none", w, shape=shape) for w in (2, 1))
    assert two["block_backward_buffer_bytes"] == 4 * block and alone["block_backward_buffer_bytes"] == 4 * block
    assert two["block_buffer_bytes"] == 2 * 2 * block  # two gathered blocks in bf16
    assert alone["block_buffer_bytes"] == 2 * block  # one rank: the running block alone
    terms, state = plan_terms(peak_terms(two), accumulating=False), device_state_bytes(two)  # one micro-batch
    before = state - two["block_buffer_bytes"]
    big, small = 10 * state, state
    # the block's backward moment: the gathered blocks and the reduce-scatter beside it
    assert peak_tensor_bytes(state, (small, big, small, 0, (), big), **terms) == before + big + 4 * block + 4 * block
    # a forward-only block peak (the backward's block moment lower): no reduce-scatter
    assert peak_tensor_bytes(state, (small, big, small, 0, (), small), **terms) == before + big + 4 * block


def test_a_plan_that_accumulates_or_not_holds_its_own_gradients():
    """What the gradients hold depends on whether a plan accumulates. One that does not: DDP and
    FSDP2 set them to None after each step, so the micro-step's peak before the first gradient
    (forward, the loss) holds none (MemTracker, 2 ranks, one micro-batch per step: GPT-NeoX bf16
    with AC 22% over with them counted). One that does, under FSDP2: the last micro-batch copies a
    block's fp32 accumulated gradients into its reduce-scatter input and frees them, so a later
    block's backward holds beside them the block's output shard and, in bf16, the running
    block's new 16-bit gradients, not a whole fp32 input more (Mixtral fp32, AC off: 4.5% over).
    DeepSpeed on a CPU zeroes its gradients in place: nothing is made anew; ZeRO-2 in fp32 holds
    one gradient partition more at the step of a plan that accumulates (MemTracker, 2 ranks, one
    micro-batch per step: Mixtral 15.7% over with it counted). Expected bytes from the shapes."""
    from memtrain.memory.peak import peak_tensor_bytes, peak_terms, plan_terms

    n, block, root = 1_000_000, 200_000, 100_000
    shape = ModelShape(n, largest_block=block, largest_module=block // 4, root=root)
    fp32, bf16 = (model_state_bytes("fsdp", n, p, None, "none", 2, shape=shape) for p in ("fp32", "bf16"))
    assert plan_terms(peak_terms(fp32), accumulating=True)["block_backward"] == 4 * block // 2
    assert plan_terms(peak_terms(bf16), accumulating=True)["block_backward"] == 4 * block // 2 + 2 * block
    one = plan_terms(peak_terms(fp32), accumulating=False)
    assert one["block_backward"] == 4 * block and one["accumulation"] == 0
    assert one["fresh"] == 4 * n // 2 + 4 * root  # the shards and the root's whole gradients
    assert plan_terms(peak_terms(fp32), accumulating=True)["fresh"] == 0
    # bf16, accumulating: every gradient in fp32 and, from the head's gradient on, the root's new
    # 16-bit ones beside them (made anew: not at the loss's peak)
    assert bf16["accumulation_gradient_bytes"] + bf16["gradient_bytes"] == 4 * n + 2 * root
    assert plan_terms(peak_terms(bf16), accumulating=True)["fresh"] == 2 * root
    assert fp32["accumulation_gradient_bytes"] + fp32["gradient_bytes"] == 4 * n  # fp32: added in place
    # one rank: the root's accumulated gradients are among the 4 bytes per parameter, not beside them
    one_rank = model_state_bytes("fsdp", n, "fp32", None, "none", 1, shape=shape)
    assert one_rank["accumulation_gradient_bytes"] + one_rank["gradient_bytes"] == 4 * n
    # two blocks: the later one's backward has nothing left to prefetch, one block gathered, not two
    pair = dataclasses.replace(shape, blocks=2)
    for precision, u in (("fp32", 4), ("bf16", 2)):
        both = model_state_bytes("fsdp", n, precision, None, "none", 2, shape=pair)
        more = model_state_bytes("fsdp", n, precision, None, "none", 2, shape=dataclasses.replace(shape, blocks=3))
        assert more["block_backward_buffer_bytes"] - both["block_backward_buffer_bytes"] == u * block
        assert more["accumulated_block_backward_buffer_bytes"] - both["accumulated_block_backward_buffer_bytes"] == (
            u * block)
    state, gathered = device_state_bytes(fp32), fp32["block_buffer_bytes"]
    big, small = 10 * state, state // 100
    # the loss's peak: no gradient yet in a plan that does not accumulate; all of them in one that does
    assert peak_tensor_bytes(state, (big, small, small), **one) == state - gathered + big - one["fresh"]
    accumulating = plan_terms(peak_terms(fp32), accumulating=True)
    assert peak_tensor_bytes(state, (big, small, small), **accumulating) == (
        state - gathered + fp32["accumulation_gradient_bytes"] + big)
    # from the first gradient on: all of them
    assert peak_tensor_bytes(state, (big, small, big), **one) == state - gathered + big
    assert model_state_bytes("ddp", n, "fp32", None, "none", 2, shape=shape)["fresh_gradient_bytes"] == 4 * n
    assert model_state_bytes("deepspeed", n, "fp32", 2, "none", 2, shape=shape).get("fresh_gradient_bytes", 0) == 0
    # ZeRO-2: the last micro-batch allocates its partition buffer at the step's moment; a plan that
    # accumulates holds the earlier micro-batches' partition beside it, one more (u bytes per
    # element over the 2 ranks). memtrain's default reduces the bucket in place: nothing else in
    # fp32; in bf16 the step's fp32 copy of the partition, made after the bucket (the model's size,
    # counted as a buffer) is freed, so only what exceeds the bucket, and the flattened bf16 copy
    # it is made from, a partition's bytes in every plan. A JSON's "reduce_scatter": true (or no
    # contiguous_gradients) reduces through a flattened copy of the whole gradients, which may
    # still be held then (gloo's worker drops it late)
    for precision, u in (("fp32", 4), ("bf16", 2)):
        fp32_partition = max(0, 4 * n // 2 - u * n)
        for json, copy in (({}, 0), ({"reduce_scatter": 1}, u * n), ({"contiguous_gradients": 0}, u * n),
                           ({"reduce_scatter": 0}, 0)):
            zero2 = model_state_bytes("deepspeed", n, precision, 2, "none", 2, shape=shape, zero_settings=json)
            assert zero2["buffer_bytes"] == u * n  # the bucket
            partition = u * n // 2
            steps = [plan_terms(peak_terms(zero2), accumulating=a)["step"] for a in (True, False)]
            flattened = partition if precision == "bf16" else 0  # held in every plan
            assert steps[0] == zero2["step_gradient_bytes"] and steps[0] - steps[1] == partition - flattened
            assert steps[1] == max(copy, fp32_partition) + partition + flattened, json
        peaks = (small, small, small)  # the step is the peak
        assert (peak_tensor_bytes(device_state_bytes(zero2), peaks, **plan_terms(peak_terms(zero2), accumulating=True))
                - peak_tensor_bytes(device_state_bytes(zero2), peaks, **plan_terms(peak_terms(zero2), accumulating=False))
                ) == partition - flattened


def test_a_plan_that_does_not_accumulate_holds_the_gradients_made_so_far():
    """In a plan that does not accumulate a moment of backward holds only the gradients made so
    far: with the trace's ``made`` peaks (the live bytes plus 4 bytes per made element, per window
    of backward, and the same with the elements outside the blocks alone) DDP counts each
    backward moment with those (4 bytes per element) and a block's forward with none (MemTracker,
    2 ranks, one micro-batch per step: Qwen2 fp32 AC off 12.9% over with every gradient counted);
    FSDP2 counts a block's made gradients as shards, 4 bytes per element over the ranks, but the
    running block's whole, and beside them a reduce-scatter input from the first block's end on
    (and the gathered blocks). Never more than every gradient; a plan that accumulates, and one
    without the made peaks, as before. Expected bytes from the shapes."""
    from memtrain.memory.peak import peak_tensor_bytes, peak_terms, plan_terms

    n, block, root = 1_000_000, 200_000, 100_000
    shape = ModelShape(n, largest_block=block, largest_module=block // 4, root=root)
    ddp = model_state_bytes("ddp", n, "fp32", None, "none", 2, shape=shape)
    state, one = device_state_bytes(ddp), plan_terms(peak_terms(ddp), accumulating=False)
    fresh = 4 * n
    live, fwd = 3 * fresh, 2 * fresh  # the backward's live peak; a block's forward peak
    made_elements = n // 10  # the head's gradients made at the backward's live peak
    made = (live + 4 * made_elements,) * 14  # every window alike, and a block's end
    peaks = (live, live, live, 0, (), live, fwd)
    before = peak_tensor_bytes(state, peaks, **one)
    assert before == state + live  # every gradient beside the live peak
    after = peak_tensor_bytes(state, (*peaks, made), **one)
    assert after == state - fresh + live + 4 * made_elements  # only those made
    accumulating = plan_terms(peak_terms(ddp), accumulating=True)
    assert peak_tensor_bytes(state, (*peaks, made), **accumulating) == peak_tensor_bytes(state, peaks, **accumulating)
    # made ones beyond every gradient: never more than all of them
    assert peak_tensor_bytes(state, (*peaks, (live + 2 * fresh,) * 14), **one) == before

    fsdp = model_state_bytes("fsdp", n, "fp32", None, "none", 2, shape=shape)
    terms, fsdp_state = plan_terms(peak_terms(fsdp), accumulating=False), device_state_bytes(fsdp)
    gathered, fresh = fsdp["block_buffer_bytes"], fsdp["fresh_gradient_bytes"]
    assert terms["made_slack"] == 4 * block and terms["block_gradient_shards"] == 2  # a reduce-scatter input
    assert terms["made_tail_slack"] == 4 * max(block, root)  # the last block's, or the root's
    outside, inside, running = n // 20, n // 10, n // 40  # made elements outside the blocks, in them, in the running one

    def made_peaks(head: int, first: int, later: int, tail: int, end: int, end_block: int) -> tuple:
        """The trace's made peaks of live bytes (per window, and at a block's end of ``end_block``
        elements) with every made element, those outside, those outside and the running block's."""
        live_of = (head, first, later, tail)
        return (*(b + 4 * (outside + inside) for b in live_of), *(b + 4 * outside for b in live_of),
                *(b + 4 * (outside + running) for b in live_of), end + 4 * (outside + inside),
                end + 4 * (outside + end_block))

    # the later blocks' window highest: the running block's whole, the others' as shards, one
    # reduce-scatter input; a block's end lower
    shards = 4 * outside + 4 * running + 4 * (inside - running) // 2
    made = made_peaks(live // 2, live // 2, live, live // 2, live // 4, block)
    expected = fsdp_state + live + shards + 4 * block - fresh
    assert peak_tensor_bytes(fsdp_state, (*peaks, made), **terms) == expected < peak_tensor_bytes(fsdp_state, peaks, **terms)
    # before the blocks (no reduce-scatter input yet) highest: the gathered blocks beside the made ones alone
    made = made_peaks(live, live // 2, live // 2, live // 2, live // 4, block)
    assert peak_tensor_bytes(fsdp_state, (*peaks, made), **terms) == fsdp_state + live + shards - fresh
    # a block's end highest: its whole gradients and its reduce-scatter input beside the gathered blocks
    made = made_peaks(live // 2, live // 2, live // 2, live // 2, live, block)
    at_end = 4 * outside + 4 * block + 4 * (inside - block) // 2
    assert peak_tensor_bytes(fsdp_state, (*peaks, made), **terms) == fsdp_state + live + at_end + 4 * block - fresh


def test_deepspeed_json_partial_and_nvme_offload_are_checked():
    from memtrain.backends.ds_config import build_ds_config
    from memtrain.config import ConfigError

    plan = dict(global_batch_size=8, micro_batch_size=2, gradient_accumulation_steps=4, max_grad_norm=1.0,
                precision="fp32", precision_requested="fp32")
    cfg = build_ds_config({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": "auto"}}}, "x.json",
                          zero_stage=3, offload=None, offload_optimizer_ratio=0.25, **plan)
    assert cfg["zero_optimization"]["offload_optimizer"]["ratio"] == 0.25
    with pytest.raises(ConfigError, match="'backend.nvme_path'.*stage 3"):
        build_ds_config(None, "x", zero_stage=2, offload="optimizer", nvme_path="/tmp", **plan)
    with pytest.raises(ConfigError, match="'backend.offload_optimizer_ratio'.*NVMe"):
        build_ds_config(None, "x", zero_stage=3, offload="optimizer", nvme_path="/tmp", offload_optimizer_ratio=0.5,
                        **plan)
    with pytest.raises(ConfigError, match="'backend.offload_optimizer_ratio'.*stage 3"):
        build_ds_config(None, "x", zero_stage=2, offload="optimizer", offload_optimizer_ratio=0.5, **plan)


def test_planner_keeps_as_much_optimizer_state_on_the_device_as_fits():
    """6.7B on 80 GB + 128 GB: all on the device does not fit, all on the host is slower (CPU Adam);
    the chosen partial offload is the smallest fraction that fits with the tuned ratio's margin (one
    step less does not)."""
    table = plan_placements(candidates(), variants(("deepspeed",), (3,), False), SHAPE, "bf16", 1, machine())
    by_name = {p.offload + str(p.offload_optimizer_ratio < 1): p for p in table}
    assert not by_name["noneFalse"].fits_device
    chosen = next(p for p in table if p.chosen)
    assert chosen.offload == "optimizer" and chosen.offload_optimizer_ratio < 1 and chosen.fits
    assert chosen.predicted_step_s < by_name["optimizerFalse"].predicted_step_s
    tighter = plan_placements([c for c in candidates() if c.micro_batch_size == chosen.micro_batch_size],
                              [Placement("deepspeed", 3, "optimizer", chosen.offload_optimizer_ratio)],
                              SHAPE, "bf16", 1, machine())[0]
    assert tighter.fits
    one_step_less = Placement("deepspeed", 3, "optimizer", round(chosen.offload_optimizer_ratio - RATIO_STEP, 4),
                              tune_ratio=True)
    from memtrain.planning.placement import _size

    _size(one_step_less, next(c for c in candidates() if c.micro_batch_size == chosen.micro_batch_size), SHAPE,
          "bf16", 1, machine())
    assert not one_step_less.fits_device


def test_a_ddp_placement_counts_the_reducer_buckets_only_without_oom_recovery():
    """DDP's reducer (OOM recovery off) holds a second fp32 copy of the gradients on more than one
    rank; with recovery on memtrain trains the model unwrapped. The copy is 4 bytes per parameter
    of the real model (torch's count; MemTracker counted it at 4 × 0.27M on 2 ranks)."""
    from torch import nn

    from memtrain.config import parse_args
    from memtrain.memory.shape import model_shape
    from memtrain.planning.placement import allowed_pool, planning_pool, state_bytes

    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8))
    n = sum(p.numel() for p in model.parameters())
    shape = model_shape(model)

    def ddp_buffers(*args):
        cfg = parse_args(["--backend.name", "ddp", *args])
        pools = allowed_pool(cfg, False) + [p for p in planning_pool(cfg, False) if p.engine == "ddp"]
        return {state_bytes(p, shape, "fp32", 2)["buffer_bytes"] for p in pools}

    assert ddp_buffers("--memory.oom_recovery", "false") == {4 * n}
    assert ddp_buffers() == {0}


def test_lossy_optimizer_states_are_planned_only_when_allowed():
    """memory.allow_lossy_levers (with memory.levers auto): the user's DDP placement is planned with
    fp32, bf16 and int8 moments, fp32 first; DeepSpeed's in fp32 only. A 1B model's fp32 DDP state
    is 16 bytes per parameter (weights, gradients, two moments), 12 with bf16 moments: on a 14 GiB
    device only the bf16 one fits and is chosen; on 80 GiB fp32 is as fast and is chosen."""
    from memtrain.config import parse_args
    from memtrain.planning.placement import allowed_pool, planning_pool

    allow = ["--memory.levers", "auto", "--memory.allow_lossy_levers", "true"]
    ddp = parse_args(["--backend.name", "ddp", *allow])
    assert [p.state_dtype for p in allowed_pool(ddp, False)] == ["fp32", "bf16", "int8"]
    counted = parse_args(["--backend.name", "ddp", *allow, "--logging.memory_breakdown_step", "2"])
    assert [p.state_dtype for p in allowed_pool(counted, False)] == ["fp32", "bf16"]  # MemTracker: no int8
    assert [p.state_dtype for p in allowed_pool(parse_args(["--backend.name", "ddp", "--memory.levers", "auto"]),
                                                False)] == ["fp32"]
    zero3 = parse_args(["--backend.name", "deepspeed", "--backend.zero_stage", "3", *allow])
    assert [p.state_dtype for p in allowed_pool(zero3, False)] == ["fp32"]
    every = planning_pool(parse_args(["--backend.offload", "auto", *allow]), False)  # every engine and offload
    order = ["fp32", "bf16", "int8"]
    assert [p.state_dtype for p in every] == sorted((p.state_dtype for p in every), key=order.index)
    assert {p.engine for p in every if p.state_dtype != "fp32"} == {"ddp", "fsdp"}
    n = 10**9
    shape = ModelShape(n, largest_block=n // 32, largest_module=n // 96)
    for device_gib, dtype in ((14, "bf16"), (80, "fp32")):
        table = plan_placements(candidates(0.05), allowed_pool(ddp, False), shape, "bf16", 1, machine(device_gib))
        assert next(p for p in table if p.chosen).state_dtype == dtype
        assert table[0].fits_device == (dtype == "fp32")  # fp32: 16 GB of state


def test_the_placement_pool_and_a_kept_placement_honour_checkpoint_format(monkeypatch):
    """``checkpoint.format`` under ``backend.offload auto``: the pool holds only the engines that
    can write it, and a resumed run whose checkpoint keeps a placement of an engine that cannot
    is refused on the field, naming the engine and the formats it can write."""
    from memtrain.config import ConfigError, parse_args
    from memtrain.planning import run_placement
    from memtrain.planning.placement import planning_pool

    every = planning_pool(parse_args(["--backend.offload", "auto"]), False)
    assert {p.engine for p in every} == {"ddp", "fsdp", "deepspeed"}
    # only the engines that write it (safetensors saves DDP's whole module only)
    for fmt, engines in (("safetensors", {"ddp"}), ("dcp", {"ddp", "fsdp"}), ("deepspeed", {"deepspeed"})):
        pool = planning_pool(parse_args(["--backend.offload", "auto", "--checkpoint.format", fmt]), False)
        assert {p.engine for p in pool} == engines, fmt
    # a resumed run keeps its checkpoint's placement: one whose engine cannot write the format is refused by name
    monkeypatch.setattr(run_placement, "resume_placement", lambda cfg: {"name": "fsdp"})
    kept = parse_args(["--backend.offload", "auto", "--checkpoint.format", "safetensors"])
    with pytest.raises(ConfigError, match="'safetensors' cannot be written by engine fsdp, whose placement the resumed "
                                          "checkpoint keeps .backend.offload auto.: choose auto or dcp$"):
        run_placement.resolve(kept, None, None, "fp32")


def test_a_lossier_state_dtype_must_be_clearly_faster_and_bf16_keeps_its_beta2_limit():
    """Where both fit, bf16 moments are taken over fp32 only when predicted more than 5% faster
    (int8 over bf16 likewise); a resumed run whose moments are bf16 is refused an adam_beta2 bf16
    cannot keep, naming the field."""
    from memtrain.config import ConfigError, parse_args
    from memtrain.planning.placement import choose, with_state_dtype

    def row(dtype, step_s, fits=True):
        return Placement("ddp", None, "none", state_dtype=dtype, predicted_step_s=step_s, fits_device=fits,
                         fits_host=True)

    assert choose([row("fp32", 1.04), row("bf16", 1.0), row("int8", 0.9)]).state_dtype == "int8"
    assert choose([row("fp32", 1.04), row("bf16", 1.0)]).state_dtype == "fp32"
    assert choose([row("fp32", 1.2), row("bf16", 1.0), row("int8", 0.97)]).state_dtype == "bf16"
    assert choose([row("fp32", 1.0, fits=False), row("bf16", 1.0)]).state_dtype == "bf16"
    assert choose([row("fp32", 1.0, fits=False)]) is None
    cfg = parse_args(["--memory.levers", "auto", "--memory.allow_lossy_levers", "true", "--training.adam_beta2", "0.999"])
    with pytest.raises(ConfigError, match="'training.adam_beta2'.*bf16"):
        with_state_dtype(cfg, "bf16")
    view = with_state_dtype(cfg, "int8")
    assert view.optimizer.state_dtype == "int8" and not view.memory.allow_lossy_levers and cfg.memory.allow_lossy_levers


def test_a_lossier_state_dtype_is_charged_its_measured_optimizer_step_before_it_may_win():
    """A row with lossier moments is charged its optimizer step's measured cost beyond fp32 moments'
    (parameters a rank steps × (1 / its rate − 1 / fp32's rate)) before it may decide the choice
    (as the row chosen or as the fastest, the 5% margin's reference), and only those dtypes' rates
    are measured: int8 rows predicted 10% faster lose to fp32 once int8's rate (10⁷ parameters/s
    against 10⁹) adds 0.099 s per step; at fp32's rate they win. Ranks using every core share
    them; a dtype whose step cannot run here is never chosen. On this CPU bf16 moments' step is
    measured slower than fp32's fused kernel."""
    import dataclasses
    import os

    import torch

    from memtrain.levers.optimizer_state import choose_charging_steps, step_seconds_over_fp32
    from memtrain.memory.machine import optimizer_params_per_s
    from memtrain.planning.placement import choose

    def row(dtype, step_s, engine="ddp"):
        return Placement(engine, None, "none", state_dtype=dtype, predicted_step_s=step_s, fits_device=True,
                         fits_host=True)

    def rates(int8):
        asked = []

        def rate(dtype, device):
            asked.append((dtype, device))
            return {"fp32": 1e9, "bf16": 5e8, "int8": int8}[dtype]
        return rate, asked

    n = 10**6
    # int8 slow: charged, then bf16 is the fastest (the margin's reference) and is charged too
    # (1e6 × (1/5e8 − 1/1e9) = 0.001 s), and fp32 is within 5% of it; int8 as fast as fp32: it wins
    # and bf16's rate is never asked
    for int8_rate, chosen, charged, bf16 in ((1e7, "fp32", n * (1e-7 - 1e-9), 0.001), (1e9, "int8", 0.0, None)):
        rate, asked = rates(int8_rate)
        table = [row("fp32", 1.0), row("bf16", 0.98), row("int8", 0.9)]
        assert choose(table).state_dtype == "int8"  # uncharged: int8 is the fastest by 10%
        best = choose_charging_steps(table, choose, n, 1, dataclasses.replace(machine(), optimizer_params_per_s=rate))
        assert best.state_dtype == chosen
        assert table[2].state_dtype_s == pytest.approx(charged) and table[2].predicted_step_s == pytest.approx(0.9 + charged)
        assert table[1].state_dtype_s == (pytest.approx(bf16) if bf16 else None)
        assert {d for d, _ in asked} == ({"fp32", "int8", "bf16"} if bf16 else {"fp32", "int8"})
    cpu = dataclasses.replace(machine(ranks=2), device_type="cpu", optimizer_params_per_s=rates(1e7)[0])
    threads = torch.get_num_threads()
    try:  # FSDP2 on 2 ranks steps half the parameters on each; 2 ranks using every core each share them
        torch.set_num_threads(os.cpu_count())
        assert step_seconds_over_fp32(row("int8", 1.0, "fsdp"), n, 2, cpu) == pytest.approx(n / 2 * 2 * (1e-7 - 1e-9))
    finally:
        torch.set_num_threads(threads)
    assert choose_charging_steps([row("int8", 0.9)], choose, n, 1, machine()).state_dtype_s is None  # no rates
    # the fastest row sets the 5% margin: an uncharged int8 there would let bf16 win where fp32 should
    table = [row("fp32", 1.0), row("bf16", 0.96), row("int8", 0.93)]
    rate = lambda dtype, device: {"fp32": 1e9, "bf16": 1e9, "int8": 1e7}[dtype]  # noqa: E731
    assert choose(table).state_dtype == "bf16"  # 0.96 is within 5% of 0.93, not fp32's 1.00
    assert choose_charging_steps(table, choose, n, 1, dataclasses.replace(machine(), optimizer_params_per_s=rate)) \
        is table[0] and table[2].state_dtype_s > 0

    calls = []

    def broken(dtype, device):  # int8's step cannot compile here: measured once, never chosen
        calls.append(dtype)
        if dtype == "int8":
            raise RuntimeError("no C++ compiler")
        return 1e9
    table = [row("fp32", 1.0), row("int8", 0.5), row("int8", 0.6, "fsdp")]
    stand_in = dataclasses.replace(machine(), optimizer_params_per_s=broken)
    assert choose_charging_steps(table, choose, n, 1, stand_in) is table[0] and calls.count("int8") == 1
    table[0].fits_device = False  # only the int8 rows fit: nothing can be chosen
    assert choose_charging_steps(table, choose, n, 1, stand_in) is None
    assert table[1].as_dict()["predicted_step_s"] is None  # JSON has no infinity
    assert optimizer_params_per_s("bf16", "cpu") < optimizer_params_per_s("fp32", "cpu")


def test_kept_int8_moments_refuse_the_memtracker_count(monkeypatch):
    """A resumed run keeps the int8 moments its planner chose; with logging.memory_breakdown_step
    (MemTracker, under which torchao's compiled step cannot run) it is refused by name before it
    starts; without it, int8 is kept."""
    from memtrain.config import ConfigError, parse_args
    from memtrain.planning import resumed

    monkeypatch.setattr(resumed, "resumed_manifest", lambda cfg: {"engine_spec": {"optimizer_state_dtype": "int8"}})
    allow = ["--memory.levers", "auto", "--memory.allow_lossy_levers", "true"]
    assert resumed.resume_state_dtype(parse_args(allow), True) == "int8"
    with pytest.raises(ConfigError, match="'logging.memory_breakdown_step'.*int8"):
        resumed.resume_state_dtype(parse_args([*allow, "--logging.memory_breakdown_step", "2"]), True)


def test_host_memory_is_a_budget_and_nvme_is_planned_only_with_a_folder():
    table = plan_placements(candidates(), variants(("deepspeed",), (3,), False), SHAPE, "bf16", 1,
                            machine(device_gib=24, host_gib=32))
    assert not any(p.chosen for p in table)  # 24 GB device, 32 GB host: nothing holds 107 GB of state
    assert any(p.fits_device and not p.fits_host for p in table)
    assert not any(p.nvme for p in variants(("deepspeed",), (3,), False))
    table = plan_placements(candidates(), variants(("deepspeed",), (3,), True), SHAPE, "bf16", 1,
                            machine(device_gib=24, host_gib=32))
    assert not any(p.chosen for p in table)  # NVMe holds the state, but the export gathers 27 GB of fp32 weights
    table = plan_placements(candidates(), variants(("deepspeed",), (3,), True), SHAPE, "bf16", 1,
                            machine(device_gib=24, host_gib=48))
    chosen = next(p for p in table if p.chosen)
    assert chosen.nvme and chosen.host_bytes <= 48 * GIB and chosen.nvme_bytes > 0
    assert chosen.host_bytes >= 4 * SHAPE.parameters  # the export's moment: the whole model in fp32 on the host
    # a run that writes no export (checkpoint.export false) is not held to that moment: 32 GB is enough
    table = plan_placements(candidates(), variants(("deepspeed",), (3,), True), SHAPE, "bf16", 1,
                            dataclasses.replace(machine(device_gib=24, host_gib=32), exports=False))
    chosen = next(p for p in table if p.chosen)
    # what remains is the build's moment: the fresh model whole in fp32 on the host (NVMe keeps too
    # little on the device to build it there), below the export's whole model beside the process
    assert chosen.nvme and chosen.host_bytes == 4 * GIB + 4 * (SHAPE.parameters + SHAPE.largest_module) <= 32 * GIB


def test_a_fresh_model_is_built_on_the_device_where_the_engine_keeps_its_bytes_else_the_host_counts_it():
    """The build's moment (every parameter in fp32, memtrain.models.build_model): on one GPU whose
    engine keeps at least those bytes on the device (ZeRO-3 all on the device, FSDP2's optimizer
    offload) the model is built there and the host never holds it; sharded over 8 ranks each
    rank's state is smaller than the whole model, so every rank builds it in host memory and the
    placement's host peak is at least 8 whole fp32 copies beside the processes. The run takes the
    same decision (model_build_device) from its configured engine."""
    from memtrain.memory.accounting import build_bytes

    whole = 4 * (SHAPE.parameters + SHAPE.largest_module)
    assert build_bytes(SHAPE) == whole
    big_host = dataclasses.replace(machine(host_gib=4096), exports=False)  # no export: its moment is whole too
    alone = plan_placements(candidates(), variants(("deepspeed",), (3,), False), SHAPE, "bf16", 1, big_host)
    on_device = next(p for p in alone if p.offload == "none")
    assert on_device.device_bytes >= whole and on_device.host_bytes < whole  # built on the GPU
    eight = dataclasses.replace(big_host, ranks_per_host=8)
    sharded = plan_placements(candidates(per_rank=2), variants(("deepspeed",), (3,), False), SHAPE, "bf16", 8, eight)
    for p in sharded:
        assert p.host_bytes >= 8 * (4 * GIB + whole), p.name


def test_the_run_builds_on_the_device_what_the_placement_planned_there(tmp_path, cache_dir):
    """model_build_device: on a CUDA device a one-rank fresh model is built there; under FSDP2 on
    8 ranks (each keeps an eighth) on the host; a CPU run, a pretrained folder and a user's module
    always on the host."""
    import torch

    from memtrain.backends.spec import resolve_engine
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import ModelSource
    from memtrain.planning.run_placement import model_build_device

    cuda = torch.device("cuda", 0)

    def device(*extra, world=1, user=None, on=cuda):
        cfg = parse_args(tiny_args(tmp_path, cache_dir, *extra))
        corpus = build_corpus(cfg.data)
        spec = resolve_engine(cfg.backend, world, 0, None)
        return model_build_device(cfg, spec, "bf16", on, ModelSource.of(cfg, corpus, user))

    assert device() == cuda
    assert device("--backend.name", "fsdp", "--backend.offload", "optimizer") == cuda
    assert device("--backend.name", "fsdp", world=8) is None
    assert device(on=torch.device("cpu")) is None
    assert device(user=torch.nn.Linear(4, 4)) is None


def test_plan_prints_a_fitting_placement_for_a_10b_llama_on_80gb_and_128gb(cache_dir):
    """``memtrain plan`` without a GPU, from the model config alone: a ≥10B Llama shape at a global
    batch of 64 sequences fits one 80 GB GPU and a 128 GiB host losslessly (fp32 master weights
    and moments), with the host under 120 GiB and 2 GiB of the GPU free beside the allocator
    headroom: FSDP2's optimizer offload, part of the optimizer state on the GPU, accumulating
    without a whole-model gradient (every micro-batch reduces into the 16-bit gradient shards; with
    FSDP2's fp32 unsharded accumulation the best split needed 85.5 GiB of GPU); every DeepSpeed
    placement needs more host (a short sequence and a small vocabulary keep the test fast)."""
    proc = run_cli(["plan", "--config", str(REPO / "recipes" / "llama_10b.yaml"), "--gpu_memory_gib", "80",
                    "--host_memory_gib", "128", "--json", "--data.max_bytes", "300000", "--data.vocab_size", "512",
                    "--data.seq_len", "256", "--model.config.num_hidden_layers", "32",
                    "--training.global_batch_size", "64", "--data.cache_dir", cache_dir])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    placements = [r for r in rows if r.get("placement")]
    chosen = next(p for p in placements if p["chosen"])
    assert chosen["fits"] and chosen["device_bytes"] <= 78 * GIB and chosen["host_bytes"] < 120 * GIB
    assert (chosen["engine"], chosen["offload"], chosen["state_dtype"]) == ("fsdp", "optimizer", "fp32")
    assert chosen["gradient_accumulation_steps"] > 1 and 80 * GIB - chosen["device_bytes"] >= 2 * GIB
    assert 0 < chosen["offload_optimizer_ratio"] < 1
    # its step waits for the host (the CPU step beyond what the next forward hides), and says so
    assert chosen["bound"] == "host" and chosen["host_step_s"] > chosen["copy_s"]
    assert chosen["device_s"] < chosen["predicted_step_s"] < chosen["device_s"] + chosen["host_step_s"] + chosen["copy_s"]
    assert not any(p["fits"] for p in placements if p["engine"] == "deepspeed")
    assert not next(p for p in placements if p["offload"] == "none")["fits"]
    assert chosen["parameters"] >= 10e9


def test_plan_answers_for_the_target_machine(cache_dir):
    """``memtrain plan --world_size 8 --gpu_memory_gib 12`` plans another machine: a recipe's
    micro-batch is replaced by the planner's (and said so: here it cannot divide a rank's share;
    with a share it divides, because another machine is planned); with its host not given, no
    placement is refused for this machine's host; the marked placement is the one the run uses
    (``backend.name auto`` without offload: DDP), with its plan's levers besides AC (chunked
    cross-entropy, asked for here), and the verdict names the host memory it needs for the ranks of
    one machine (``--nodes 2``: half of them)."""
    from conftest import TINY_ARGS

    i = TINY_ARGS.index("--training.micro_batch_size")
    recipe_micro = TINY_ARGS[:i] + TINY_ARGS[i + 2:]  # the recipe's own micro-batch (16)

    def plan(*extra):
        proc = run_cli(["plan", *recipe_micro, "--world_size", "8", "--gpu_memory_gib", "12", "--data.cache_dir",
                        cache_dir, *extra])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    proc = plan("--training.global_batch_size", "16", "--memory.chunked_cross_entropy", "true")
    assert "does not divide a rank's share" in proc.stderr
    table = proc.stdout.split("placements (", 1)[1]
    assert "host memory not given" in table and "no (host)" not in table
    marked = [line for line in table.splitlines() if "*" in line.split()]
    assert [line.split()[0] for line in marked] == ["ddp"]
    assert marked[0].rstrip().endswith("+ chunked CE")  # the plan's levers besides AC, last
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("verdict:"))
    assert "model state ddp:" in verdict and "GiB host for the 8 rank(s) of a machine" in verdict
    assert "the smallest host that runs it" in verdict
    divides = plan("--training.global_batch_size", "128", "--json", "--nodes", "2")
    assert "another machine is planned" in divides.stderr
    rows = [json.loads(line) for line in divides.stdout.splitlines()]
    ddp = next(r for r in rows if r.get("placement") and r["name"] == "ddp")
    whole = [json.loads(line) for line in plan("--training.global_batch_size", "128", "--json").stdout.splitlines()]
    assert ddp["host_bytes"] < next(r for r in whole if r.get("placement") and r["name"] == "ddp")["host_bytes"]


def test_the_verdict_says_what_the_run_will_use():
    """Under ``backend.offload auto`` the verdict is the chosen placement's plan (not the candidate
    table of the engine without offload, which may not fit); otherwise the marked plan on the
    config's placement, and a faster placement is pointed at; every lever the plan turns on is
    named. The CPU Adam rate is named with its source."""
    from memtrain.estimate import verdict

    placement = {"name": "zero3 optimizer 68%→host", "micro_batch_size": 1, "gradient_accumulation_steps": 16,
                 "activation_checkpointing": "on", "predicted_step_s": 7.1, "device_bytes": 79 * GIB,
                 "host_bytes": 129 * GIB, "fits": True, "fits_host": True, "chosen": True, "offload": "optimizer"}
    report = {"candidates": [], "budget_bytes": 80 * GIB, "world_size": 1, "placement_decides": True,
              "placements": [placement], "cpu_adam_source": "reference",
              "machine": {"host_bytes": 130 * GIB, "ranks_per_host": 1, "cpu_adam_params_per_s": 3.3e9}}
    words = verdict(report)
    assert "places model state as zero3 optimizer 68%→host, micro-batch 1 × accumulation 16" in words
    assert "no micro-batch plan fits" not in words and "3.3G parameters/s, the reference rate" in words
    assert "no placement fits" in verdict({**report, "placements": [{**placement, "chosen": False}]})
    fixed = {**report, "placement_decides": False, "micro_batch_given": False,
             "candidates": [{"chosen": True, "micro_batch_size": 4, "gradient_accumulation_steps": 2, "fits": True,
                             "activation_checkpointing": "on", "predicted_peak_bytes": 10 * GIB}],
             "placements": [{**placement, "name": "ddp", "offload": "none", "predicted_step_s": 0.06},
                            {**placement, "name": "fsdp", "offload": "none", "chosen": False, "predicted_step_s": 0.05}]}
    words = verdict(fixed)
    assert words.startswith("verdict: micro-batch 4 × accumulation 2 per rank, activation checkpointing on")
    assert "model state ddp:" in words and "fsdp is predicted faster" in words
    # a lever besides activation checkpointing that the plan turns on is named, not only AC
    assert "checkpointing on, chunked CE, about" in verdict(
        {**report, "placements": [{**placement, "levers": {"chunked_cross_entropy": True, "activation_offload": "off"}}]})
    fixed["candidates"][0]["chunked_cross_entropy"] = True
    assert "checkpointing on, chunked CE, predicted peak" in verdict(fixed)


def test_plan_exits_3_when_nothing_fits(cache_dir):
    """``memtrain plan`` prints its report and exits 3 (a run's code for out of memory at the plan
    floor) when the run would have nothing to start from; a micro-batch the config fixes counts as
    a start even where it is predicted not to fit (the run recovers from there)."""
    from conftest import TINY_ARGS
    from memtrain.estimate import something_fits

    i = TINY_ARGS.index("--training.micro_batch_size")
    proc = run_cli(["plan", *TINY_ARGS[:i], "--training.micro_batch_size", "auto", *TINY_ARGS[i + 2:],
                    "--gpu_memory_gib", "0.0001", "--data.cache_dir", cache_dir])
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "verdict: no micro-batch plan fits" in proc.stdout
    fits, too_big = {"chosen": True, "fits": True}, {"chosen": True, "fits": False}
    assert something_fits({"placement_decides": True, "candidates": [], "placements": [fits]})
    assert not something_fits({"placement_decides": True, "candidates": [fits], "placements": [too_big]})
    assert something_fits({"candidates": [too_big], "placements": []})
    assert not something_fits({"candidates": [fits], "placements": [{**fits, "fits_host": False}]})
    assert not something_fits({"candidates": [{"chosen": False, "fits": False}], "placements": [fits]})


def test_the_plan_marked_is_the_plan_the_run_uses(tmp_path, cache_dir):
    """With a fixed micro-batch (2 of a rank's 8 samples) the row ``memtrain plan`` marks is the
    plan a run of the same config trains its first step with (its metrics), not the planner's
    fastest (a larger micro-batch fits the unbounded CPU budget)."""
    from conftest import tiny_args
    from memtrain.train import main

    args = tiny_args(tmp_path, cache_dir, "--training.max_steps", "1")
    proc = run_cli(["plan", "--json", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    marked = [r for r in rows if not r.get("placement") and r["chosen"]]
    assert any(r["micro_batch_size"] > 2 and r["fits"] for r in rows if not r.get("placement"))
    first = main(args).records[0]
    assert [(r["micro_batch_size"], r["gradient_accumulation_steps"], r["activation_checkpointing"]) for r in marked] \
        == [(first["micro_batch_size"], first["gradient_accumulation_steps"], first["activation_checkpointing"])]


def test_an_offload_the_host_cannot_hold_is_refused_before_start(tmp_path, cache_dir):
    """Exit 2 with the numbers, before the model is built and before anything is written."""
    out = tmp_path / "run"
    proc = run_cli(tiny_args(out, cache_dir, "--backend.name", "deepspeed", "--backend.offload", "optimizer",
                             "--memory.host_memory_gib", "0.01"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "memory.host_memory_gib" in proc.stderr and "GiB of host memory" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


# ZeRO-3 with the parameters on the host and half of the optimizer state kept on the device
PLACED = ["--backend.name", "deepspeed", "--backend.zero_stage", "3", "--backend.offload", "optimizer_and_params",
          "--backend.offload_optimizer_ratio", "0.5"]
SIX_STEPS = ["--training.max_steps", "6", "--checkpoint.every_steps", "2"]


def test_partial_and_parameter_offload_resume_exactly(tmp_path, cache_dir):
    """Killed inside step 5 and resumed from step 4, every step equals the uninterrupted run's
    bitwise: the device half's Adam moments come back from memtrain's file (DeepSpeed saves only the
    host half's), and the device optimizer does not step the host's partitions again after the load."""
    from conftest import launch, read_metrics

    base, run = tmp_path / "continuous", tmp_path / "killed"
    launch(tiny_args(base, cache_dir, *PLACED, *SIX_STEPS), nproc=1)
    kill = ["--faults.kill_at_step", "5", "--faults.kill_mid_step", "true"]
    assert launch(tiny_args(run, cache_dir, *PLACED, *SIX_STEPS, *kill), nproc=1, check=False).returncode != 0
    assert (run / "checkpoints" / "step_00000004" / "zero" / "device_optimizer_rank_0.pt").stat().st_size > 0
    launch(tiny_args(run, cache_dir, *PLACED, *SIX_STEPS, *kill), nproc=1)
    records, ref = read_metrics(run), read_metrics(base)
    assert [r["step"] for r in records] == list(range(1, 7)) and records[4]["event"].startswith("resume")
    for r, b in zip(records, ref):
        for key in ("lr", "batch_fingerprint", "loss", "grad_norm"):
            assert r[key] == b[key], (r["step"], key, r[key], b[key])


def test_nvme_offload_trains_like_host_offload(tmp_path, cache_dir):
    """The same placement with its offloaded state in NVMe files: the same losses (the same CPU Adam
    on the same values)."""
    from conftest import launch, read_metrics
    from memtrain.backends.deepspeed import nvme_available

    if not nvme_available():
        pytest.skip("NVMe offload needs DeepSpeed's async_io op (libaio and its headers), not built on this machine")
    args = ["--backend.name", "deepspeed", "--backend.zero_stage", "3", "--backend.offload", "optimizer_and_params",
            "--training.max_steps", "4"]
    launch(tiny_args(tmp_path / "host", cache_dir, *args), nproc=1)
    (tmp_path / "nvme").mkdir()
    launch(tiny_args(tmp_path / "files", cache_dir, *args, "--backend.nvme_path", str(tmp_path / "nvme")), nproc=1)
    assert [r["loss"] for r in read_metrics(tmp_path / "files")] == [r["loss"] for r in read_metrics(tmp_path / "host")]


def test_offload_auto_moves_state_to_the_host_when_the_device_cannot_hold_it(tmp_path, cache_dir):
    """On the simulated device of 1 MiB the tiny model's ZeRO-3 state alone does not fit: offload
    auto chooses a placement with state on the host, and the run trains without running out of memory."""
    from conftest import launch, read_metrics

    budget = 1.0
    launch(tiny_args(tmp_path, cache_dir, "--backend.name", "deepspeed", "--backend.zero_stage", "3",
                     "--backend.offload", "auto", "--faults.memory_budget_mib", str(budget),
                     "--training.max_steps", "3"), nproc=1)
    table = json.loads((tmp_path / "placement.json").read_text())["placements"]
    chosen = next(p for p in table if p["chosen"])
    assert chosen["offload"] != "none" and chosen["device_bytes"] <= budget * 2**20
    assert not next(p for p in table if p["offload"] == "none")["fits_device"]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert not any("oom" in (r.get("event") or "") for r in records)
    assert max(r["simulated_peak_bytes"] for r in records) <= budget * 2**20


def test_planning_never_compiles_deepspeeds_cpu_adam(tmp_path, monkeypatch):
    """With no cpu_adam built (an empty extension folder), measuring the CPU Adam rate uses torch's
    AdamW and builds nothing (a first build takes minutes, in silence before)."""
    from memtrain.memory.machine import cpu_adam_built, cpu_adam_params_per_s

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not cpu_adam_built()
    assert cpu_adam_params_per_s(2**16) > 0
    assert not any(tmp_path.iterdir())  # nothing was built


def test_plan_times_the_host_optimizer_at_the_target_rate(cache_dir):
    """``--cpu_adam_params_per_s`` (the target host's CPU Adam rate) times the optimizer of every
    placement that offloads it, and only those (FSDP2's optimizer offload hides part of it behind
    the next forward); the report says the rate was given."""
    from conftest import TINY_ARGS
    from memtrain.config import parse_args
    from memtrain.estimate import plan_report

    cfg = parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir])
    slow, fast = (plan_report(cfg, 1, cpu_adam_params_per_s=rate) for rate in (1e5, 1e9))
    assert slow["cpu_adam_source"] == "given" and slow["machine"]["cpu_adam_params_per_s"] == 1e5
    from memtrain.memory.machine import REFERENCE_CPU_ADAM_PARAMS_PER_S

    target = plan_report(cfg, 1, gpu_memory_gib=12)  # another machine, its rate not given: the reference, said so
    assert target["cpu_adam_source"] == "reference"
    assert target["machine"]["cpu_adam_params_per_s"] == REFERENCE_CPU_ADAM_PARAMS_PER_S
    base = [p["predicted_step_s"] for r in (slow, fast) for p in r["placements"] if p["name"] == "ddp"]
    compute = base[0] - base[1]  # each report measures this machine's matmul rate anew: the same for every row
    for a, b in zip(slow["placements"], fast["placements"]):
        assert a["name"] == b["name"]
        on_host = 0.0 if a["offload"] == "none" else a["offload_optimizer_ratio"] if a["offload"] == "optimizer" else 1.0
        expected = slow["parameters"] * on_host * (1 / 1e5 - 1 / 1e9)  # one rank: its optimizer's parameters
        assert a["host_step_s"] - b["host_step_s"] == pytest.approx(expected, rel=0.05, abs=1e-6), a["name"]
        added = a["predicted_step_s"] - b["predicted_step_s"] - compute
        if a["engine"] == "fsdp" and a["offload"] == "optimizer":  # overlapped with the next forward: at most that
            assert -1e-3 <= added <= expected + 1e-3, a["name"]
        else:
            assert added == pytest.approx(expected, rel=0.05, abs=1e-3), a["name"]


def test_plan_times_steps_at_the_target_gpus_rate(cache_dir):
    """``--gpu_tflops`` (the target GPU's rate) sets the FLOP/s every step time is computed at:
    the report's machine names it, and halving it doubles each candidate's compute seconds
    (the 1 ms per micro-batch aside)."""
    from conftest import TINY_ARGS
    from memtrain.config import parse_args
    from memtrain.estimate import plan_report

    cfg = parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir])
    fast, slow = (plan_report(cfg, 1, gpu_memory_gib=12, gpu_tflops=t) for t in (400, 200))
    assert fast["machine"]["device_flops"] == 400e12 and slow["machine"]["device_flops"] == 200e12
    for a, b in zip(fast["candidates"], slow["candidates"]):
        launches = 1e-3 * a["gradient_accumulation_steps"]
        assert b["predicted_step_s"] - launches == pytest.approx(2 * (a["predicted_step_s"] - launches), rel=1e-6)


def test_cpu_info_is_asked_once_per_process(monkeypatch):
    """py-cpuinfo starts a Python subprocess per call and DeepSpeed asks it in every CPU Adam
    constructor: after memtrain prepares the libraries, the first answer is kept (each caller
    gets its own copy) and a real DeepSpeedCPUAdam takes its vendor from it."""
    import cpuinfo
    import torch

    from memtrain.distributed import cache_cpu_info

    calls, real = [], cpuinfo.get_cpu_info()

    def asked():
        calls.append(1)
        return dict(real)

    monkeypatch.setattr(cpuinfo, "get_cpu_info", asked)
    cache_cpu_info()
    cache_cpu_info()  # idempotent: not wrapped twice
    first, second = cpuinfo.get_cpu_info(), cpuinfo.get_cpu_info()
    assert first == second == asked() and first is not second and len(calls) == 2  # one cached + the direct call
    from memtrain.memory.machine import cpu_adam_built

    if cpu_adam_built():
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])
        assert len(calls) == 2  # DeepSpeed's own call got the kept answer


def test_allowed_lossy_states_are_chosen_where_fp32_cannot_fit_and_kept_on_resume(tmp_path, cache_dir):
    """DDP with memory.levers auto and memory.allow_lossy_levers on a 0.75 MiB simulated device, where
    the tiny model's fp32 state does not fit beside its activations and its state with bf16 moments
    does: the run takes bf16 moments (placement.json marks that row, charged its measured optimizer
    step; the metrics, the checkpoint's engine spec and its saved moments say bf16) and
    never runs out of memory. Resumed on a roomy device, where a fresh run keeps fp32, it keeps bf16."""
    from conftest import launch, read_metrics

    def run(out, *extra):
        # no activation offload: it would let fp32 fit (it moves the activations off the device)
        return launch(tiny_args(out, cache_dir, "--backend.name", "ddp", "--memory.levers", "auto",
                                "--memory.activation_offload", "off",
                                "--memory.allow_lossy_levers", "true", "--training.micro_batch_size", "auto",
                                "--checkpoint.every_steps", "2", *extra))

    run(tmp_path, "--faults.memory_budget_mib", "0.75", "--training.max_steps", "2")  # bf16 moments fit 0.65-0.82
    table = json.loads((tmp_path / "placement.json").read_text())["placements"]
    assert [p["state_dtype"] for p in table if p["chosen"]] == ["bf16"]
    assert next(p for p in table if p["chosen"])["state_dtype_s"] is not None  # its measured step cost charged
    assert not next(p for p in table if p["state_dtype"] == "fp32")["fits_device"]
    records = read_metrics(tmp_path)
    assert [r["optimizer_state_dtype"] for r in records] == ["bf16", "bf16"]
    assert not any("oom" in (r.get("event") or "") for r in records)
    saved = tmp_path / "checkpoints" / "step_00000002"
    assert json.loads((saved / "manifest.json").read_text())["engine_spec"]["optimizer_state_dtype"] == "bf16"
    import torch

    moments = torch.load(saved / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    assert {s["exp_avg"].dtype for s in moments.values()} == {torch.bfloat16}
    run(tmp_path, "--training.max_steps", "3")  # no budget now
    assert [r["optimizer_state_dtype"] for r in read_metrics(tmp_path)[2:]] == ["bf16"]
    run(tmp_path / "fresh", "--training.max_steps", "1")
    assert read_metrics(tmp_path / "fresh")[0]["optimizer_state_dtype"] == "fp32"


def test_the_optimizer_offloads_pinned_buffer_is_counted_as_torch_allocates_it(monkeypatch):
    """FSDP2's optimizer offload keeps its host buffers in one block, pinned on a GPU, which torch's
    caching host allocator rounds up to a power of two: a GPU plan counts the rounding (all of the
    optimizer on the host: training, not the export, is the host's peak then)."""
    from memtrain.planning import placement as planning

    assert (planning.pinned_rounding_bytes(3 * GIB), planning.pinned_rounding_bytes(GIB),
            planning.pinned_rounding_bytes(0)) == (GIB, 0, 0)
    state = planning.state_bytes(Placement("fsdp", None, "optimizer", 1.0), SHAPE, "bf16", 1)
    assert state["pinned_block_bytes"] == state["offloaded_buffer_bytes"] > 0
    rounding = planning.pinned_rounding_bytes(state["pinned_block_bytes"])
    (counted,) = plan_placements(candidates(), [Placement("fsdp", None, "optimizer", 1.0)], SHAPE, "bf16", 1,
                                 machine(host_gib=1000))
    monkeypatch.setattr(planning, "pinned_rounding_bytes", lambda block: 0)
    (uncounted,) = plan_placements(candidates(), [Placement("fsdp", None, "optimizer", 1.0)], SHAPE, "bf16", 1,
                                   machine(host_gib=1000))
    assert rounding > 0 and counted.host_bytes - uncounted.host_bytes == rounding


def test_fsdp_partial_offload_is_planned_named_and_run_at_the_share_whole_parameters_hold():
    """FSDP2's optimizer offload holds whole parameters (the last of the model), so a share such as
    72% can be unreachable: with one large first parameter (an embedding of 80% of the elements)
    the offload holds either the blocks (20%) or everything. Every partial row the planner tries
    is a share the run's own split (``PartialOffloadAdamW``'s ``host_split`` over the real
    parameters) holds exactly, and its name says that share — never a nominal 72% that runs as 100%."""
    import torch

    from memtrain.memory.shape import model_shape
    from memtrain.backends.optimizer_offload import host_split
    from memtrain.planning import placement

    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), *[torch.nn.Linear(64, 64) for _ in range(4)])
    params = list(model.parameters())
    shape = model_shape(model)
    total = sum(p.numel() for p in params)
    partial = next(p for p in variants(("fsdp",), (), False) if p.tune_ratio)
    tried = placement._ratios(partial, shape)
    assert tried and all(0 < r < 1 for r in tried)
    for ratio in tried:  # what the run would put on the host for this row
        held = sum(p.numel() for p in params if id(p) in host_split(params, ratio))
        assert held / total == pytest.approx(ratio, abs=1e-12)
    assert max(tried) < 0.21  # the blocks' share (1 - 64000/80640): 72% is not among them
    table = plan_placements(candidates(0.0001), [partial], shape, "fp32", 1, machine(device_gib=1, host_gib=1))
    row = table[0]
    held = sum(p.numel() for p in params if id(p) in host_split(params, row.offload_optimizer_ratio))
    assert f"{held / total:.0%}→host" in row.name


def test_plan_counts_the_optimizer_state_a_partial_offload_keeps_on_the_device(cache_dir):
    """``memtrain plan --backend.offload optimizer --backend.offload_optimizer_ratio 0.5`` (FSDP2):
    the micro-batch candidates count the half of the optimizer state the run keeps on the device —
    by the bytes a real ``PartialOffloadAdamW`` over the built model holds there at each share
    (they were planned as if all of it were on the host: a 2-rank GPT-2 small step 14% under
    MemTracker's count)."""
    from conftest import TINY_ARGS
    from memtrain.config import parse_args
    from memtrain.estimate import plan_report
    from memtrain.models import build_model
    from memtrain.backends.optimizer_offload import PartialOffloadAdamW

    def planned_state(ratio):
        cfg = parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir, "--backend.name", "fsdp", "--backend.offload",
                                      "optimizer", "--backend.offload_optimizer_ratio", str(ratio)])
        row = next(c for c in plan_report(cfg, 1)["candidates"] if c["micro_batch_size"] == 2)
        return row["predicted_peak_bytes"] - row["activation_bytes"], cfg

    def held_on_device(cfg, ratio):
        net = build_model(cfg.model, 512)
        groups = [{"params": list(net.parameters()), "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}]
        opt = PartialOffloadAdamW(groups, list(net.parameters()), ratio)
        try:
            return opt.state_bytes()["device"]
        finally:
            opt.close()

    (half, cfg), (whole, _) = planned_state(0.5), planned_state(1.0)
    expected = held_on_device(cfg, 0.5) - held_on_device(cfg, 1.0)
    assert expected > 0 and half - whole == pytest.approx(expected, rel=0.05)


def test_the_plan_counts_the_zero_buffer_sizes_a_users_deepspeed_json_sets(tmp_path, cache_dir):
    """A user's DeepSpeed JSON that raises ZeRO-3's persistence threshold above every parameter
    makes DeepSpeed keep each parameter whole on every rank (its ``mark_persistent_parameters``): the
    plan, `memtrain memory`'s configured state and every placement row, counts them whole too, as
    the running engine does (the JSON read by the same function); without the JSON the model's
    largest parameters are partitioned and the plan counts less than the whole model."""
    import json

    from memtrain.backends.spec import user_zero_settings
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.planning.placement import configured_state_bytes, model_facts, state_bytes

    path = tmp_path / "zero3.json"
    path.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10**9}}))
    base = tiny_args(tmp_path / "out", cache_dir, "--backend.name", "deepspeed", "--backend.zero_stage", "3",
                     "--model.config.n_embd", "256")
    plain, persistent = parse_args(base), parse_args(base + ["--backend.deepspeed_config", str(path)])
    shape, _ = model_facts(plain, build_corpus(plain.data))
    assert max(shape.numels) > 100_000  # DeepSpeed's default threshold partitions the largest
    assert user_zero_settings(persistent) == {"stage3_param_persistence_threshold": 10**9} and not user_zero_settings(plain)
    whole = 4 * shape.parameters
    assert configured_state_bytes(plain, shape, "fp32", 2)["parameter_bytes"] < whole
    assert configured_state_bytes(persistent, shape, "fp32", 2)["parameter_bytes"] >= whole
    row = Placement("deepspeed", 3, "none")
    assert state_bytes(row, shape, "fp32", 2, user_zero_settings(persistent))["parameter_bytes"] >= whole
    from memtrain.backends.spec import resolve_engine
    from memtrain.planning.placement import allowed_pool, placement_table

    # the placement table too: a JSON that gathers no more than the module being run (no prefetch,
    # no reuse) holds fewer gathered parameters than DeepSpeed's defaults
    narrow = tmp_path / "narrow.json"
    narrow.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0,
                                                        "stage3_max_reuse_distance": 0}}))
    gathering = parse_args(base + ["--backend.deepspeed_config", str(narrow)])
    corpus = build_corpus(plain.data)
    planned = {name: placement_table(cfg, resolve_engine(cfg.backend, 2, 0), corpus, 2, machine(), "fp32",
                                     allowed_pool(cfg, False))[0]
               for name, cfg in (("plain", plain), ("narrow", gathering))}
    assert planned["narrow"].device_bytes <= planned["plain"].device_bytes
    gathered = {name: state_bytes(row, shape, "fp32", 2, user_zero_settings(cfg))["block_buffer_bytes"]
                for name, cfg in (("plain", plain), ("narrow", gathering))}
    assert 0 < gathered["narrow"] < gathered["plain"]



def test_a_stage_a_users_deepspeed_json_sets_is_the_stage_planned(tmp_path):
    """A DeepSpeed JSON that sets ZeRO-3 without ``backend.zero_stage`` is planned as ZeRO-3, the
    stage the engine builds: the same model-state bytes as ``--backend.zero_stage 3`` (it was planned
    as ZeRO-2, the accounting's default for an unset stage, which at a small micro-batch is below
    what ZeRO-3 holds). Its offload and ratio are the JSON's too."""
    from memtrain.config import parse_args
    from memtrain.planning.placement import allowed_pool, configured_state_bytes

    path = tmp_path / "zero3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}))
    base = ["--config", str(REPO / "recipes" / "code_lm_tiny.yaml")]
    from_json = parse_args(base + ["--backend.deepspeed_config", str(path)])
    from_flags = parse_args(base + ["--backend.name", "deepspeed", "--backend.zero_stage", "3", "--backend.offload",
                                    "optimizer", "--backend.offload_optimizer_ratio", "0.5"])
    shape = ModelShape(2_000_000, largest_block=400_000, largest_module=200_000, root=400_000,
                       numels=(200_000,) * 9 + (1_000,) * 200)
    assert configured_state_bytes(from_json, shape, "fp32", 2) == configured_state_bytes(from_flags, shape, "fp32", 2)
    assert configured_state_bytes(from_json, shape, "fp32", 2) != configured_state_bytes(
        parse_args(base + ["--backend.name", "deepspeed", "--backend.zero_stage", "2", "--backend.offload", "optimizer"]),
        shape, "fp32", 2)
    (row,) = {(p.engine, p.zero_stage, p.offload, p.offload_optimizer_ratio) for p in allowed_pool(from_json, False)}
    assert row == ("deepspeed", 3, "optimizer", 0.5)

def test_the_plan_fits_the_resume_and_export_moments_beside_its_steps():
    """A plan that fits its steps must fit its resume and its export (:mod:`memtrain.memory.moments`):
    FSDP2 on 8 ranks holds an eighth of the model between steps, but rank 0's export copies every
    state-dict entry (a tied parameter under each name) in fp32, which on a CPU is device memory,
    more than any step here; on a GPU that copy is host memory. The resume adds the gradient shards
    torch's optimizer-state initialization makes. The moment decides whether a plan fits, never
    which one is smaller: every plan keeps its own step peak, so the planner still finds a smaller
    one after an out-of-memory error. Expected bytes from the shapes."""
    from memtrain.memory.peak import peak_terms
    from memtrain.memory.moments import largest_moment_bytes, moment_terms
    from memtrain.planning.planner import Planner, make_candidates

    n, tied = 1_000_000, 50_000
    shape = ModelShape(n, largest_block=100_000, largest_module=tied, root=100_000, numels=(tied,) * 20, tied=tied)
    eight = model_state_bytes("fsdp", n, "fp32", None, "none", 8, shape=shape)
    held = eight["held_bytes"]
    assert held == 4 * n // 8 + 8 * n // 8  # fp32 parameter shards and AdamW's moments
    cpu, gpu = moment_terms(eight, "cpu"), moment_terms(eight, "cuda")
    assert gpu["resume"] == cpu["resume"] == held + 4 * n // 8
    assert cpu["export"] == held + 4 * (n + tied) and gpu["export"] == held + 4 * tied  # one parameter gathered

    def acts(plan):
        return 1000 * plan.micro_batch_size

    assert largest_moment_bytes(eight, "cpu") == cpu["export"] and largest_moment_bytes(eight, "cuda") == gpu["resume"]
    steps = make_candidates(8, {}, device_state_bytes(eight), acts, "cpu", None, peak_terms(eight))
    peaks = [c.predicted_peak_bytes for c in steps]
    moment = 2 * max(peaks)  # a moment above every step's peak
    candidates = make_candidates(8, {}, device_state_bytes(eight), acts, "cpu", None, peak_terms(eight), moment)
    assert [c.predicted_peak_bytes for c in candidates] == peaks and len(set(peaks)) == len(peaks)
    assert all(c.moment_bytes == moment and c.planned_bytes == moment for c in candidates)
    between = make_candidates(8, {}, device_state_bytes(eight), acts, "cpu", max(peaks), peak_terms(eight), moment)
    assert not any(c.fits for c in between)  # every step fits, the moment does not
    roomy = Planner(make_candidates(8, {}, device_state_bytes(eight), acts, "cpu", moment, peak_terms(eight), moment),
                    moment)
    assert all(c.fits for c in roomy.candidates)
    largest = max(roomy.candidates, key=lambda c: c.predicted_peak_bytes)
    smaller = roomy.after_oom(largest.plan)
    assert smaller is not None and smaller.predicted_peak_bytes < largest.predicted_peak_bytes


def test_a_save_stages_on_the_host_what_its_checkpoint_format_copies():
    """The host bytes a save stages are the format's, not the engine's: DDP writing safetensors
    hands ``torch.save`` its whole optimizer state (copied to the host at once), DDP writing dcp
    copies one tensor at a time (the largest, whole on every rank count, and the writer's
    copy-ahead, taken from torch's ``FileSystemWriter``), so the same placement needs that much
    less host memory; FSDP2 (dcp) copies a rank's shard of it, and with ``checkpoint.async_save``
    its whole optimizer state, which DDP, saving synchronously, never stages."""
    import inspect

    from torch.distributed.checkpoint import FileSystemWriter

    from memtrain.planning.placement import state_bytes

    copy_ahead = inspect.signature(FileSystemWriter.__init__).parameters["per_thread_copy_ahead"].default

    def host(checkpoint_format, async_save=False, engine="ddp", ranks=1):
        p = Placement(engine, None, "none", checkpoint_format=checkpoint_format, async_save=async_save)
        no_export = dataclasses.replace(machine(ranks=ranks), exports=False)  # the export's host peak is larger
        (planned,) = plan_placements(candidates(per_rank=16 // ranks), [p], SHAPE, "bf16", ranks, no_export)
        return planned.host_bytes // ranks

    for ranks in (1, 2):
        optimizer = state_bytes(Placement("ddp", None, "none"), SHAPE, "bf16", ranks)["optimizer_bytes"]
        assert host("auto", ranks=ranks) == host("safetensors", ranks=ranks)  # DDP's own
        assert host("safetensors", ranks=ranks) - host("dcp", ranks=ranks) == optimizer - (
            4 * SHAPE.largest_module + copy_ahead), ranks
        assert host("dcp", True, ranks=ranks) == host("dcp", ranks=ranks)  # DDP saves synchronously
    sharded = state_bytes(Placement("fsdp", None, "none"), SHAPE, "bf16", 2)["optimizer_bytes"]
    assert host("auto", True, "fsdp", 2) - host("auto", False, "fsdp", 2) == sharded - (
        4 * SHAPE.largest_module // 2 + copy_ahead)
