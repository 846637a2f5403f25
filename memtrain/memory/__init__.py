"""Memory: everything memtrain knows and decides about bytes and the seconds they cost.

* :mod:`memtrain.memory.accounting` — bytes of model state per engine, ZeRO stage, offload and
  precision (parameters, gradients, optimizer state), the allocator's headroom: written once,
  used by the engines, the planner and the placement planner alike.
* :mod:`memtrain.memory.machine` — facts of the machine a run plans for: device and host budgets,
  the device's matmul rate, CPU Adam's rate, a process's own resident bytes.
* :mod:`memtrain.memory.simulated` — the simulated device of a CPU run (``faults.memory_budget_mib``),
  also the planner's counter of saved activations.
* :mod:`memtrain.memory.planner` — candidate plans, peaks from a fake-tensor trace, timed probes,
  the decisions (before step 1, after an OOM, grow-back).
* :mod:`memtrain.memory.placement` — where model state lives (``backend.offload: auto``) and the
  engine spec of a run.
* :mod:`memtrain.memory.estimate` — ``memtrain plan`` / ``memtrain memory``: the planner's view
  of a config without a run (a command-line view of the modules above).
"""
