"""The independent count of a step's memory (memtrain.memory.breakdown): MemTracker as the run enters it."""

import torch


def test_the_tracker_hooks_no_parameter_at_each_forward():
    """torch 2.13's module tracker, inside MemTracker, registers a gradient hook of mode ``all`` on
    a module's grad-requiring inputs at every forward. A weight-norm parametrization's inputs are
    its parameters, on which such hooks live on, and under DeepSpeed ZeRO-3 their buffers kept the
    gradient of every backward (the speech model's positional convolution: three bf16 copies,
    393 kB, 1.5% of the counted peak, which no run without the tracker holds). The run's tracker
    (``logging.memory_breakdown_step``) registers none on a parameter however many forwards run,
    where the stock tracker adds one a forward; and it counts what the stock tracker counts here
    (the same bytes after each step and the same peak: the module tracker's inputs feed only its
    per-module statistics)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from memtrain.memory.breakdown import _tracker

    def after_steps(tracker) -> tuple[list[int], list[int], int]:
        torch.manual_seed(0)
        conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 64, 5), name="weight", dim=2)
        v = conv.parametrizations.weight.original1
        x, counts, hooks = torch.randn(2, 4, 32), [], []
        with tracker:
            for _ in range(3):
                tracker.reset_mod_stats()  # the stock tracker refuses a root module's second call without it
                conv(x).square().sum().backward()
                for p in conv.parameters():
                    p.grad = None
                counts.append(sum(s["Total"] for s in tracker.get_tracker_snapshot("current").values()))
                hooks.append(len(v._backward_hooks or {}))
            peak = sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
        return counts, hooks, peak

    counts, hooks, peak = after_steps(_tracker())
    stock_counts, stock_hooks, stock_peak = after_steps(MemTracker())
    assert hooks[0] == hooks[2], hooks
    assert stock_hooks[2] - stock_hooks[0] == 2, stock_hooks  # one more a forward
    assert counts == stock_counts and peak == stock_peak > 0, (counts, stock_counts, peak, stock_peak)
