"""Memory: the facts memtrain knows about bytes and the seconds they cost (no decisions).

* :mod:`memtrain.memory.accounting` — bytes of model state per engine, offload and precision
  (parameters, gradients, optimizer state), the allocator's headroom: written once, used by the
  engines, the planner and the placement planner alike; DeepSpeed's per ZeRO stage in
  :mod:`memtrain.memory.zero_accounting`.
* :mod:`memtrain.memory.host_limit` — the host's real limit: the smallest of the available memory,
  the cgroup's, the processes' resource limits and ``memory.host_memory_gib``, and which it is.
* :mod:`memtrain.memory.machine` — facts of the machine a run plans for: device and host budgets,
  the device's matmul rate, CPU Adam's rate, a process's own resident bytes.
* :mod:`memtrain.memory.simulated` — the simulated device of a CPU run (``faults.memory_budget_mib``),
  also the planner's counter of saved activations.
* :mod:`memtrain.memory.step_trace`, :mod:`memtrain.memory.depth` — a step's peak from a fake-tensor trace.
* :mod:`memtrain.memory.breakdown` — MemTracker's count of one real step.

The decisions made from these facts (the micro-batch planner, the placement planner, a resumed
run's plan) live above the engines and levers, in :mod:`memtrain.planning`.
"""
