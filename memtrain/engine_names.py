"""The engines memtrain has, by name: the one registry line a new engine adds (its module is
``memtrain.backends.NAME``; :mod:`memtrain.backends.engine` says what it defines). Kept apart from
:mod:`memtrain.backends` so the config reads the choices without importing an engine."""

ENGINES = ("ddp", "fsdp", "deepspeed")
"""Every engine, in the order the placements are listed."""
ENGINE_CHOICES = ("auto", *ENGINES)
"""The values of ``backend.name``."""
