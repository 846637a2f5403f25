"""memtrain: a memory-optimized PyTorch trainer.

One loop over DDP, FSDP2 and DeepSpeed ZeRO, built around the global batch as the
unit of work (see docs/design.md).
"""

__version__ = "0.1.0"
