"""A rank's peak tensor bytes, composed from an engine's model state (:mod:`memtrain.memory.accounting`)
and the peaks of a traced micro-step (:class:`memtrain.memory.step_trace.StepPeaks`): the moments of
a step (before a micro-batch's forward, inside a block, in backward, the optimizer step) and which
of an engine's terms each holds, for a plan that accumulates and one that does not. The planner,
the placement planner and ``memtrain plan`` compose a candidate's peak here.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from memtrain.memory.accounting import device_state_bytes


def peak_tensor_bytes(device_state: int, peaks: Sequence, accumulation: int = 0, step: int = 0,
                      block: int = 0, backward: int = 0, kept: int = 0, block_backward: int = 0,
                      fresh: int = 0, made_slack: Optional[int] = None, made_tail_slack: int = 0,
                      block_gradient_shards: int = 1) -> int:
    """Tensor bytes on a rank's device at its peak, the largest of four moments, from ``peaks`` =
    (peak, in_block, in_backward[, resident[, kept peaks[, in_block_backward[, in_block_forward[, made]]]]]) of a traced micro-step
    (:class:`memtrain.memory.step_trace.StepPeaks`; a None is the peak; ``resident``, the rank's
    batch, is held at every moment). ``device_state`` is the model state on the device with every buffer;
    before a micro-step's forward a rank holds it less ``block`` and ``backward``, plus
    ``accumulation`` in a plan that accumulates (gradients kept from the earlier micro-batches):

    - the micro-step's peak (saved activations and transients) beside that;
    - its peak while a repeated block runs, beside that and ``block``, the part of the state an
      engine holds only then (``block_buffer_bytes``: FSDP2's two gathered blocks, ZeRO-3's
      gathered parameters), released outside the blocks (at the loss's peak, say); and its peak
      while a block runs its backward beside ``block`` and ``block_backward``
      (``block_backward_buffer_bytes``: FSDP2's reduce-scatter of the block before; in a plan
      that accumulates, ``accumulated_block_backward_buffer_bytes``: :func:`plan_terms`);
    - its peak from the first parameter gradient on, beside that and ``backward``, what an engine
      allocates for backward (``backward_buffer_bytes``: ZeRO-2's reduce bucket); before it the
      state holds ``fresh`` bytes less, the gradients a micro-step makes anew (:func:`plan_terms`),
      so the micro-step's own peak in forward or at the loss does not count them;
    - the optimizer step: ``device_state`` less ``block`` (nothing is gathered then) and ``step``
      (``step_gradient_bytes``: the gradients the step reads, which the accumulated ones have
      become; the activations freed).

    ``kept`` (``view_kept_bytes``: ZeRO-3's parameters that are gathered, on more than one rank)
    takes the trace's peaks with the gathered parameters a saved view keeps alive
    (``StepPeaks.kept``) for the three micro-step moments; while a block runs those and ``block``
    together are never more than ``kept``, all of them. And a moment of ZeRO-3's forward: from
    the second micro-batch on, DeepSpeed gathers the parameters used next in one coalesced
    buffer (up to ``block``) and copies each out of it, the buffer held until the last is claimed
    (:func:`zero_state_bytes`); so while a block runs its forward, ``block`` is held beside the
    trace's forward peak with the copies not yet released (``StepPeaks.kept``'s fourth: the
    parameters kept by a view and those whose module has not yet run), never more than
    ``block_in_forward + kept``, nor the copies not yet released more than ``block`` (the most
    DeepSpeed keeps gathered: a large model's prefetch reaches ``stage3_prefetch_bucket_size``
    elements ahead, not the whole model).

    A plan that does not accumulate holds, at a moment of backward, only the gradients made so far
    (``made_slack`` given, not None: :func:`plan_terms`): at most 4 bytes per element of the
    parameters whose gradient has arrived, a repeated block's over ``block_gradient_shards``
    (FSDP2 keeps them as shards) but the running block's whole, plus ``made_slack`` from the
    first block's reduce on (FSDP2: a block's reduce-scatter input) and ``made_tail_slack``
    after the blocks (the last block's or the root's), and never more than ``fresh``. With the
    trace's ``made`` peaks (``StepPeaks.made``: the live bytes plus 4 bytes per made element,
    per window of backward and at a block's end) each backward moment is counted with those
    instead of every gradient, and a block's forward with none (:func:`_made_so_far`).

    MemTracker on 2 ranks (``benchmarks/memory_accuracy.py --families``: Llama, Mistral, Qwen2,
    GPT-NeoX, GPT-2, Mixtral, Qwen2-MoE of 0.6–2M parameters) finds each engine's state before the last
    micro-batch's forward as above and its peak at one of these moments.
    """
    peak = peaks[0]
    in_block, in_backward = (peak if p is None else p for p in peaks[1:3])
    resident = peaks[3] if len(peaks) > 3 else 0
    block_in_backward = peaks[5] if len(peaks) > 5 and peaks[5] is not None else in_block
    during_block = max(in_block + block, block_in_backward + block + block_backward)
    if kept and len(peaks) > 4 and peaks[4]:
        peak, kept_in_block, in_backward, *forward = peaks[4]
        block_in_forward = peaks[6] if len(peaks) > 6 and peaks[6] is not None else in_block
        during_block = min(kept_in_block + block, in_block + kept)
        if forward:  # ZeRO-3's forward: the coalesced buffer beside the copies not yet released
            during_block = max(during_block, block + min(forward[0], block_in_forward + kept, kept_in_block + block))
    made = peaks[7] if len(peaks) > 7 and peaks[7] else ()
    if made and made_slack is not None and fresh > 0 and not (kept and len(peaks) > 4 and peaks[4]):
        block_in_forward = peaks[6] if len(peaks) > 6 and peaks[6] is not None else in_block
        shards = max(1, block_gradient_shards)
        # a moment's live bytes, made elements outside the blocks and the running block's at 4
        # bytes, the other blocks' at 4 over the shards: the same mix of the two peaks, rounded up
        windows = [running - (running - every) // shards
                   for every, running in zip((*made[:4], made[12]), (*made[8:12], made[13]))]
        during_block, in_backward = _made_so_far(windows, (made_slack, made_tail_slack), fresh, block,
                                                 block_backward, in_block, block_in_forward, block_in_backward,
                                                 in_backward)
    before_forward = device_state - block - backward + accumulation
    micro_step = before_forward + max(peak - fresh, during_block, in_backward + backward)
    return max(micro_step, device_state - block + step) + resident


def _made_so_far(made: Sequence[int], slacks: tuple[int, int], fresh: int, block: int, block_backward: int,
                 in_block: int, block_in_forward: int, block_in_backward: int, in_backward: int) -> tuple[int, int]:
    """:func:`peak_tensor_bytes`' terms while a block runs and from the first gradient on, beyond
    the state before forward (which holds every gradient, ``fresh``), for a plan that does not
    accumulate, from ``made`` = the (before the blocks', the first block's, the later blocks',
    between and after them, at a block's end) peaks of backward's live bytes plus the gradients
    made (at most: 4 bytes per element, the blocks' but the running one's over their shards:
    ``StepPeaks.made`` has the peaks with every made element and with those outside the blocks
    and in the running one: at any moment the live bytes plus 4 bytes per made element outside
    the blocks or in the running one and 4/shards per other one are a mix of the two, so never
    more than the same mix of their peaks). ``slacks`` = (beside a block's backward from the
    first block's reduce on, after the blocks): what an engine holds beyond the made gradients
    (FSDP2's reduce-scatter input, allocated at a block's end). A moment's gradients are the
    made ones (plus the slack), never more than ``fresh``: each window counts the smaller of its
    live peak beside every gradient and its made peak beside those alone; a block's forward
    holds none; between the blocks ``block`` may be held too (FSDP2's prefetched block while the
    block before is reduced).

    Returns:
        (while a block runs, from the first gradient on), bytes.
    """
    slack, tail_slack = slacks
    head, first, later, tail, end = made
    head, later, tail = head - fresh, later + slack - fresh, tail + tail_slack - fresh
    first = max(first, end + slack) - fresh
    during_block = max(block_in_forward - fresh + block, min(in_block, max(first, later - slack)) + block,
                       min(block_in_backward, later - slack) + block + block_backward)
    return during_block, min(in_backward, max(head, first, later, tail) + block)


def peak_terms(state_bytes: Mapping[str, int]) -> dict[str, int]:
    """An engine's terms of the peak from a ``model_state_bytes`` dict, for a plan that accumulates
    and one that does not alike (:func:`plan_terms` picks)."""
    block_backward = state_bytes.get("block_backward_buffer_bytes", 0)
    step = state_bytes.get("step_gradient_bytes", 0) + state_bytes.get("step_gathered_bytes", 0)
    return {"accumulation": state_bytes.get("accumulation_gradient_bytes", 0),
            "step": step - state_bytes.get("step_accumulated_partition_bytes", 0), "accumulated_step": step,
            "block": state_bytes.get("block_buffer_bytes", 0),
            "backward": state_bytes.get("backward_buffer_bytes", 0), "kept": state_bytes.get("view_kept_bytes", 0),
            "block_backward": block_backward,
            "accumulated_block_backward": state_bytes.get("accumulated_block_backward_buffer_bytes", block_backward),
            "fresh": state_bytes.get("fresh_gradient_bytes", 0),
            "accumulated_fresh": state_bytes.get("accumulated_fresh_gradient_bytes", 0),
            "made_slack": state_bytes.get("made_gradient_slack_bytes", 0),
            "made_tail_slack": state_bytes.get("made_gradient_tail_slack_bytes", 0),
            "block_gradient_shards": state_bytes.get("block_gradient_shards", 1)}


def plan_terms(terms: Mapping[str, int], accumulating: bool) -> dict[str, int]:
    """The keyword arguments of :func:`peak_tensor_bytes` from :func:`peak_terms`' ``terms`` for a
    plan that accumulates (``gradient_accumulation_steps > 1``: the accumulated gradients, the
    block-backward term that holds beside them, and as ``fresh`` the gradients made anew beside
    them, ``accumulated_fresh_gradient_bytes``, and at the step the gradients it holds then,
    ``step_accumulated_partition_bytes`` more) or does not (no accumulated gradients; as
    ``fresh`` every gradient an engine sets to None after a step, ``fresh_gradient_bytes``, of
    which a moment of backward holds those made so far and the slacks, ``made_gradient_slack_bytes``
    and ``made_gradient_tail_slack_bytes``; a plan that accumulates is counted with every one)."""
    out = {k: v for k, v in terms.items() if not k.startswith("accumulated_")}
    if accumulating:
        out.update(block_backward=terms.get("accumulated_block_backward", out.get("block_backward", 0)),
                   step=terms.get("accumulated_step", out.get("step", 0)),
                   fresh=terms.get("accumulated_fresh", 0), made_slack=None)
    else:
        out["accumulation"] = 0
    return out


def state_peak_tensor_bytes(state_bytes: Mapping[str, int], peaks: Sequence[Optional[int]], *,
                            accumulating: bool) -> int:
    """:func:`peak_tensor_bytes` of a ``model_state_bytes`` dict for a plan that accumulates or not."""
    return peak_tensor_bytes(device_state_bytes(state_bytes), peaks, **plan_terms(peak_terms(state_bytes), accumulating))
