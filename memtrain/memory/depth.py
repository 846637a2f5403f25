"""A model's traced bytes from a few shortened traces: a model of alike blocks is traced with its
first few blocks only and the bytes extrapolated to its full depth where the growth per block is
exact (:func:`by_depth`), so planning a 48-block model costs three traces of a few blocks."""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn


def by_depth(model: nn.Module, blocks: list[nn.Module], period: int, trace: Callable[[], int]) -> int:
    """``trace()``'s bytes for ``model``, traced at a few depths and extrapolated when that is exact.

    A model of ``L`` alike blocks (same class, same parameter shapes, in one ``nn.ModuleList``, and
    no per-layer kinds in its config: transformers' ``layer_types`` all one) is traced with only its
    first ``2·period``, ``3·period`` and ``4·period`` blocks (``period``: the activation-checkpointing
    pattern, which repeats every ``period`` blocks; two repetitions at least, so a block's backward
    after another one's, ``StepPeaks.in_block_backward``, is in every trace). When the three peaks
    grow by the same number of bytes per ``period`` blocks, the peak of all ``L`` is the first plus
    that step ``L / period − 2`` times: a 48-block model costs three traces of 9 blocks in all
    instead of one of 48. Otherwise (fewer than ``7·period`` blocks, where the whole trace is as cheap; ``L``
    not a multiple of ``period``; blocks that differ; a model that cannot run shortened; steps
    that differ) the whole model is traced. The peak is the largest of the step's phases, each
    growing linearly with depth; were a phase that grows faster to overtake the others only past
    ``4·period`` blocks, the extrapolation would be low — in transformer blocks every phase
    holds the same saved activations per block, and the results equal the whole trace on GPT-2
    and Llama shapes with AC off, selective and on (tests/test_planner.py, ``memtrain plan``'s
    10B Llama).

    Args:
        model: a fake model (:func:`memtrain.memory.step_trace.fake_model`); its block list is restored before returning.
        blocks: its repeated blocks (:func:`memtrain.models.repeated_blocks`).
        period: blocks per repetition of the levers' pattern (1 when every block is alike).
        trace: traces ``model`` as it stands and returns bytes (e.g. :func:`step_trace.step_peak_bytes`),
            or a tuple of byte counts (each extrapolated; all must grow alike per ``period`` blocks).

    Returns:
        Bytes, or the tuple (``trace()`` of the whole model, or its extrapolation).
    """
    holder = _block_list(model, blocks)
    depth = len(blocks)
    if holder is None or depth % period or depth < 7 * period:
        return trace()
    parent, name, full = holder
    peaks = []
    try:
        for k in (2 * period, 3 * period, 4 * period):
            setattr(parent, name, full[:k])
            peaks.append(trace())
    except Exception:  # noqa: BLE001 — a model that cannot run shortened is traced whole
        peaks = []
    finally:
        setattr(parent, name, full)
    counts = [p if isinstance(p, tuple) else (p,) for p in peaks]
    steps = [tuple(b - a for a, b in zip(x, y)) for x, y in zip(counts, counts[1:])]
    if len(peaks) < 3 or steps[0] != steps[1]:
        return trace()
    whole = tuple(a + (depth // period - 2) * d for a, d in zip(counts[0], steps[0]))
    return whole if isinstance(peaks[0], tuple) else whole[0]


def _block_list(model: nn.Module, blocks: list[nn.Module]) -> Optional[tuple[nn.Module, str, nn.ModuleList]]:
    """``(parent, attribute, list)`` of the ``nn.ModuleList`` that is exactly ``blocks``, when they
    are alike (one class, the same parameter shapes, one kind in ``config.layer_types``); else None."""
    kinds = getattr(getattr(model, "config", None), "layer_types", None)
    if not blocks or (kinds is not None and len(set(map(str, kinds))) > 1):
        return None
    shapes = [tuple(p.shape) for p in blocks[0].parameters()]
    if any(type(b) is not type(blocks[0]) or [tuple(p.shape) for p in b.parameters()] != shapes for b in blocks):
        return None
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == len(blocks) and all(
                    a is b for a, b in zip(child, blocks)):
                return parent, name, child
    return None
