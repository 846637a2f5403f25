"""Precision selection: ``auto|bf16|fp16|fp32``.

``auto`` picks bf16 where the device computes it natively (CUDA compute capability ≥ 8.0, or a
CPU with bf16 instructions such as AVX512-BF16/AMX) and fp32 otherwise. It never picks fp16:
on V100-class GPUs bf16 is not native and fp16 overflows in speech models; fp16 (with dynamic
loss scaling) is used only when asked for.
"""

from __future__ import annotations

from typing import Optional

import torch

from memtrain.config import ConfigError
from memtrain.errors import NonFiniteStop

PRECISIONS = ("auto", "bf16", "fp16", "fp32")


def device_supports_bf16(device_type: str, cuda_capability: Optional[tuple[int, int]] = None,
                         cpu_bf16: Optional[bool] = None) -> bool:
    """Whether the device has native bf16 arithmetic.

    Args:
        device_type: ``cuda`` or ``cpu``.
        cuda_capability: (major, minor); None = ask the current CUDA device.
        cpu_bf16: override for the CPU check; None = ask oneDNN.
    """
    if device_type == "cuda":
        major, _ = cuda_capability if cuda_capability is not None else torch.cuda.get_device_capability()
        return major >= 8
    if cpu_bf16 is not None:
        return cpu_bf16
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(requested: str, device_type: str, **probe) -> str:
    """Turn the ``precision`` setting into ``bf16``, ``fp16`` or ``fp32``.

    Args:
        requested: one of :data:`PRECISIONS`.
        device_type: ``cuda`` or ``cpu``.
        **probe: ``cuda_capability`` / ``cpu_bf16`` overrides for :func:`device_supports_bf16`.

    Raises:
        ConfigError: ``requested`` is not a known precision (names ``precision`` and the choices),
            or fp16 on CPU.
    """
    if requested not in PRECISIONS:
        raise ConfigError("precision", f"'{requested}' is not one of {', '.join(PRECISIONS)}")
    if requested == "fp16" and device_type == "cpu":
        # Accelerate would silently train in fp32 (no CPU fp16 autocast, no loss scaler)
        raise ConfigError("precision", "fp16 needs a CUDA GPU (fp16 autocast with dynamic loss scaling); "
                          "on CPU choose bf16, fp32 or auto")
    if requested != "auto":
        return requested
    return "bf16" if device_supports_bf16(device_type, **probe) else "fp32"


class NonFiniteGuard:
    """Counts consecutive optimizer steps skipped for a non-finite loss or gradient norm.

    The loss and the gradient norm it looks at are global (all-reduced over ranks), so every rank
    reaches the same decision without another collective.

    Args:
        max_consecutive: ``training.max_nonfinite_steps``; reaching it raises :class:`NonFiniteStop`.
    """

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.streak = 0

    def state_dict(self) -> dict:
        """The current streak (saved in checkpoints)."""
        return {"streak": self.streak}

    def load_state_dict(self, state: dict) -> None:
        self.streak = state["streak"]

    def update(self, step: int, loss: float, grad_norm: float) -> bool:
        """Record one step's outcome; returns True when the step was skipped.

        Raises:
            NonFiniteStop: the ``max_consecutive``-th consecutive skip.
        """
        import math

        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak = 0
            return False
        self.streak += 1
        if self.streak >= self.max_consecutive:
            raise NonFiniteStop(
                f"{self.streak} consecutive steps (up to step {step}) had a non-finite loss or gradient norm "
                f"(last: loss {loss}, grad_norm {grad_norm}); stopping (training.max_nonfinite_steps = "
                f"{self.max_consecutive}). The last checkpoint holds the last good weights. Try a lower training.lr, "
                "precision bf16 or fp32 instead of fp16, or training.max_grad_norm")
        return True
