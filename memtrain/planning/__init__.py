"""Planning: the decisions made from :mod:`memtrain.memory`'s facts, above the engines and levers.

* :mod:`memtrain.planning.planner` — candidate plans, peaks from a fake-tensor trace, timed probes,
  the decisions (before step 1, after an OOM, grow-back).
* :mod:`memtrain.planning.placement` — where model state lives (``backend.offload: auto``) and the
  engine spec of a run.
* :mod:`memtrain.planning.resumed` — what a resumed run keeps of its checkpoint's plan.

``memtrain plan`` / ``memtrain memory`` (:mod:`memtrain.estimate`) show their view of a config
without a run.
"""
