"""memtrain: a memory-optimized PyTorch trainer.

One loop over DDP, FSDP2 and DeepSpeed ZeRO, built around the global batch as the
unit of work (see docs/design.md). From Python: :class:`memtrain.Trainer` (docs/python.md).
"""

__version__ = "0.1.0"

__all__ = ["Trainer", "Config", "ConfigError", "CheckpointError", "OutputError", "CollectiveError", "OOMStop",
           "NonFiniteStop", "UserObjective", "TrainerCallback", "TrainerState", "EarlyStopping", "CallbackError"]

_EXPORTS = {"Trainer": "memtrain.api", "Config": "memtrain.config", "ConfigError": "memtrain.errors",
            "CheckpointError": "memtrain.errors", "OutputError": "memtrain.errors", "CollectiveError": "memtrain.errors",
            "OOMStop": "memtrain.oom", "NonFiniteStop": "memtrain.precision",
            "UserObjective": "memtrain.objectives", "TrainerCallback": "memtrain.callbacks",
            "TrainerState": "memtrain.callbacks", "EarlyStopping": "memtrain.callbacks",
            "CallbackError": "memtrain.callbacks"}


def __getattr__(name: str):
    """``memtrain.Trainer`` and the errors, imported on first use (``import memtrain`` stays light)."""
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'memtrain' has no attribute '{name}'")
