"""The two moments of a run outside its steps: loading a checkpoint on resume and the export at
the end. Neither holds activations, but each holds more than the state kept between steps, and a
plan that fits its steps must fit them too (:func:`largest_moment_bytes`; a planner's candidate
plans the larger of it and its step peak: ``Candidate.planned_bytes``).

Each engine's ``model_state_bytes`` dict carries five keys from here (bytes per rank):

- ``held_bytes``: the model state a rank's device holds between two steps (the gradients and the
  activations freed; an engine's buffers that live only in forward and backward left out): what
  a resumed run holds once its checkpoint is loaded, and what the export runs beside;
- ``load_bytes`` and ``export_bytes``: what the checkpoint's load and the export hold beside
  ``held_bytes`` on an accelerator (the files' reads and rank 0's copy of the whole model go to
  host memory there: :mod:`memtrain.planning.placement` counts the export's copy, not yet the
  reads);
- ``load_cpu_bytes`` and ``export_cpu_bytes``: the same where the device is the CPU, whose memory
  the reads and the copies share (a copy to the CPU of a tensor there is the tensor itself);
- ``weights_read_bytes``: the whole weights a load reads before it reads the optimizer state and
  frees after (DDP's safetensors file; 0 where they are read into place), which
  :func:`with_optimizer_bytes` needs.

MemTracker (``logging.memory_breakdown_step`` on the first step after a resume, which is the run's
last: ``before_step_peak_bytes`` and ``export_peak_bytes``; ``benchmarks/moment_accuracy.py``)
counts both moments on every engine; the allocations here were found by logging every tensor of
0.4 MB or more that torch creates during a resume's load, with its caller.

A resume from another engine's checkpoint (the engine switch) has a moment of its own
(:func:`switch_resume_bytes`, from :data:`SWITCH_KEYS` and what the checkpoint's format reads:
its ``full_state_read_bytes``): every rank reads the whole weights and optimizer state (DeepSpeed's
format through its universal checkpoint) and holds them until the engine has taken its share. A
switch to DDP, or to FSDP2 without offload, gives the read moments to the optimizer as they are
(cut to the rank's shards under FSDP2: :func:`memtrain.backends.common.load_full_state_as_read`),
with no optimizer state built first; ZeRO builds its partition's moments and writes the read
state as a universal checkpoint its own loader reads. ``memtrain plan`` counts it when the
checkpoint it would resume was written by another engine
(:func:`memtrain.planning.resumed.switch_read`; ``moment_accuracy.py --switch`` checks it).
"""

from __future__ import annotations

from typing import Mapping


def parameter_element_bytes(precision: str) -> int:
    """Bytes per element of a parameter in the compute dtype of ``precision`` (``bf16``/``fp16``:
    2, else 4): what a 16-bit engine holds its parameters and gathers them in."""
    return 2 if precision in ("bf16", "fp16") else 4


MOMENT_KEYS = ("held_bytes", "load_bytes", "export_bytes", "load_cpu_bytes", "export_cpu_bytes", "weights_read_bytes")
"""The keys of a ``model_state_bytes`` dict this module adds."""
SWITCH_KEYS = ("switch_before_bytes", "switch_shared_bytes", "switch_take_bytes")
"""The keys an engine's accounting adds for a resume from another engine's checkpoint
(:func:`switch_resume_bytes`): what a rank holds when the read begins, what of ``held_bytes`` the
read optimizer state itself becomes, and what the engine adds while it takes its share."""


def _moments(held: int, load: int, export: int, load_cpu: int, export_cpu: int, weights_read: int = 0,
             switch: tuple[int, int, int] = (0, 0, 0)) -> dict[str, int]:
    return {**dict(zip(MOMENT_KEYS, (held, load, export, load_cpu, export_cpu, weights_read))),
            **dict(zip(SWITCH_KEYS, switch))}


def switch_resume_bytes(state: Mapping[str, int], read_bytes: int, read_peak_bytes: int, device_type: str) -> int:
    """The device bytes of a resume from another engine's checkpoint (the engine switch:
    :meth:`memtrain.backends.base.Backend.load_full_state`), from ``state``'s :data:`SWITCH_KEYS`
    and what the checkpoint's format reads (``read_bytes``: the whole weights and optimizer
    state its ``read_full_state`` returns; ``read_peak_bytes``: the most it holds while reading;
    the format's ``full_state_read_bytes``).

    On a CPU the read is the device's memory: the larger of the read (``switch_before_bytes`` +
    ``read_peak_bytes``) and the take (``held_bytes`` − ``switch_shared_bytes`` + ``read_bytes`` +
    ``switch_take_bytes``: the read is held until the engine has its share). On an accelerator
    the read is host memory, and the device holds ``held_bytes`` + ``switch_take_bytes``."""
    held = state["held_bytes"]
    if device_type != "cpu":
        return held + state["switch_take_bytes"]
    return max(state["switch_before_bytes"] + read_peak_bytes,
               held - state["switch_shared_bytes"] + read_bytes + state["switch_take_bytes"])


def with_optimizer_bytes(state: Mapping[str, int], optimizer_bytes: int) -> dict[str, int]:
    """``state`` (a ``model_state_bytes`` dict with this module's keys) with ``optimizer_bytes`` of
    optimizer state on the device instead (a Python caller's optimizer): what is held between
    steps changes by the difference, and a load that reads the weights before the optimizer state
    holds beside the parameters the larger of the two."""
    out = {**state, "optimizer_bytes": optimizer_bytes}
    if "held_bytes" in state:
        out["held_bytes"] = state["held_bytes"] + optimizer_bytes - state["optimizer_bytes"]
        if state.get("switch_shared_bytes"):  # the read moments become this optimizer's state
            out["switch_shared_bytes"] = optimizer_bytes
        if state.get("weights_read_bytes"):
            out["load_cpu_bytes"] = max(0, state["weights_read_bytes"] - optimizer_bytes)
    return out


def largest_moment_bytes(state_bytes: Mapping[str, int], device_type: str) -> int:
    """The device bytes of the larger of the two moments on ``device_type`` (:func:`moment_terms`),
    which a plan must fit beside its steps' peak; 0 where ``state_bytes`` has none of these keys."""
    return max(moment_terms(state_bytes, device_type).values())


def ddp_moments(state: Mapping[str, int], shape) -> dict[str, int]:
    """DDP (``state``: :func:`memtrain.memory.accounting._ddp`'s dict; ``shape``: a
    :class:`memtrain.memory.shape.ModelShape`). Between steps every rank holds its fp32
    parameters, AdamW's moments and, with DDP's reducer, its buckets. The load reads the whole
    weights (4 bytes per parameter of the safetensors file) into host memory, copies them into the
    parameters and frees them before the optimizer state is read into host memory and moved to the
    device as the state itself: beside the parameters, the larger of the weights read and the
    optimizer state. The export copies each fp32 parameter to the host (the parameter itself on a
    CPU): nothing more on the device."""
    held = state["parameter_bytes"] + state["optimizer_bytes"] + state["buffer_bytes"]
    weights = 4 * shape.parameters
    # the switch: the read moments become the optimizer's state as they are, the weights are
    # copied into the parameters
    switch = (held - state["optimizer_bytes"], state["optimizer_bytes"], 0)
    return _moments(held, 0, 0, max(0, weights - state["optimizer_bytes"]), 0, weights, switch)


def fsdp_moments(state: Mapping[str, int], shape, precision: str, world_size: int, offload: str) -> dict[str, int]:
    """FSDP2 (``state``: :func:`memtrain.memory.accounting._fsdp`'s dict). Between steps a rank holds
    its parameter and optimizer shards; the root unit's gathered parameters, the gradients and the
    gathered blocks are freed. The load first builds the optimizer state as
    ``torch.distributed.checkpoint.state_dict`` does for an optimizer without one (a step on zero
    gradients: each rank's fp32 gradient shard, 4 bytes per trained parameter over the ranks; none
    under ``CPUOffloadPolicy``, which holds the shards on the host, nor under the optimizer offload,
    whose :class:`memtrain.backends.optimizer_offload.PartialOffloadAdamW` builds its state at start), then
    reads the shards into place. The export (``get_model_state_dict``, full, offloaded to the CPU)
    gathers one parameter at a time (the largest: 4 bytes per element; more than one rank) and
    copies it to rank 0's host; on a CPU the gathered tensor is rank 0's copy: every state-dict
    entry in fp32, a tied parameter under each of its names (on one rank the shard is the whole
    parameter: nothing is gathered or copied)."""
    u = parameter_element_bytes(precision)
    held = state["parameter_bytes"] - u * shape.root + state["optimizer_bytes"]
    load = 4 * shape.trained // world_size if offload in (None, "none") else 0
    gathered = 4 * shape.largest_parameter if world_size > 1 else 0
    copies = 4 * (shape.parameters + shape.tied) if world_size > 1 else 0
    # the switch: torch's set_model_state_dict keeps each rank's cut of the read weights in the
    # read dict (4 bytes per parameter over the ranks); without offload the moments are cut to the
    # rank's shards as views of the read ones, which the optimizer keeps as its state; with one,
    # torch's set_state_dict first builds the state by a step on a zero gradient shard
    if offload in (None, "none"):
        switch = (held - state["optimizer_bytes"], state["optimizer_bytes"], 4 * shape.parameters // world_size)
    else:
        switch = (held, 0, 4 * shape.parameters // world_size + 4 * shape.trained // world_size)
    return _moments(held, load, gathered, load, max(gathered, copies), switch=switch)


def zero_moments(state: Mapping[str, int], shape, precision: str, zero_stage, world_size: int,
                 offload: str) -> dict[str, int]:
    """DeepSpeed ZeRO (``state``: :func:`memtrain.memory.zero_accounting._zero`'s dict). Between steps a
    rank holds its parameters (partitions and ZeRO-3's persistent ones), its optimizer partition and
    the buffers DeepSpeed keeps (ZeRO-3's gradient partition and reduce bucket), not ZeRO-3's
    gathered parameters nor ZeRO-2's backward bucket. DeepSpeed's load reads the module's file and
    the rank's ZeRO file (its fp32 master partition and AdamW's moments) into host memory; torch's
    ``Optimizer.load_state_dict`` moves the moments to the device as the state itself, the master
    partition is copied into place. On a CPU the read master partition (4 bytes per element of the
    partition) is held beside the state: exactly so under ZeRO-1/2; under ZeRO-3 an upper bound (the
    three tensors are read beside a state that does not yet hold all a step makes it hold:
    MemTracker counts up to 0.8 of a master partition less). The export gathers one module's own
    parameters at a time (ZeRO-3: the largest module's, in the parameters' dtype; on one rank only
    with the parameters offloaded, the others being views of their partitions); rank 0 copies every
    parameter to its host in fp32, a tied one once (a 16-bit one cast first, on the device: the
    largest parameter, 4 bytes per element)."""
    stage = 2 if zero_stage is None else zero_stage
    p_bytes = parameter_element_bytes(precision)
    held = (state["parameter_bytes"] + state["optimizer_bytes"] + state["gradient_bytes"] + state["buffer_bytes"]
            - state["block_buffer_bytes"] - state["backward_buffer_bytes"])
    master = 4 * shape.trained // world_size if offload in (None, "none") and stage >= 1 else 0
    alone = world_size == 1 and offload != "optimizer_and_params"  # views of the partitions, as in _zero
    gathered = p_bytes * shape.largest_module if stage >= 3 and not alone else 0
    largest = 4 * shape.largest_parameter
    cast = largest if p_bytes == 2 else 0
    # the switch: ZeRO-1/2 builds AdamW's moments in the rank's partition during DeepSpeed's
    # universal load (:meth:`memtrain.backends.deepspeed.DeepSpeedBackend.load_full_state`; 8 bytes
    # per trained parameter over the ranks, where they are on the device), by a step on a zero
    # fp32 gradient partition beside them (``initialize_optimizer_states``). ZeRO-3 builds its
    # moments when the engine is set up; when the read begins it holds less than ``held`` by
    # buffers it allocates later (MemTracker on the 2-rank benchmark model: 10.0 bytes per
    # parameter against held's 14.3), so held less the moments bounds it there, and the load
    # adds a transient counted as one fp32 parameter, a bound not traced to its allocation
    # (MemTracker: 0.9 MB against the 1 MB of that model's largest parameter)
    moments = 8 * shape.trained // world_size if offload in (None, "none") else 0
    take = 4 * shape.trained // world_size if stage < 3 else largest
    return _moments(held, 0, gathered + cast, master, gathered + cast + 4 * shape.parameters,
                    switch=(held - moments, 0, take))


def moment_terms(state_bytes: Mapping[str, int], device_type: str) -> dict[str, int]:
    """``resume`` and ``export``: the device bytes of the two moments, ``held_bytes`` and what
    each adds on ``device_type`` (its ``*_cpu_bytes`` where that is ``"cpu"``); 0 where
    ``state_bytes`` has none of these keys."""
    if "held_bytes" not in state_bytes:
        return {"resume": 0, "export": 0}
    cpu = "_cpu" if device_type == "cpu" else ""
    held = state_bytes["held_bytes"]
    read = state_bytes.get("switch_read_bytes")
    resume = (held + state_bytes[f"load{cpu}_bytes"] if read is None else
              switch_resume_bytes(state_bytes, read, state_bytes["switch_read_peak_bytes"], device_type))
    return {"resume": resume, "export": held + state_bytes[f"export{cpu}_bytes"]}


def with_switch(state_bytes: Mapping[str, int], read_bytes: int, read_peak_bytes: int) -> dict[str, int]:
    """``state_bytes`` of a run that resumes another engine's checkpoint: its resume moment is
    the switch's (:func:`switch_resume_bytes`; ``read_bytes`` and ``read_peak_bytes`` from the
    checkpoint's format, ``full_state_read_bytes``), not its own load's."""
    return {**state_bytes, "switch_read_bytes": read_bytes, "switch_read_peak_bytes": read_peak_bytes}
