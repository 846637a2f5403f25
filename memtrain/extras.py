"""The optional parts of the install (``pip install 'memtrain[speech]'`` and so on): which modules
each extra brings, and the error a feature gives when its extra is missing. A text-only run (the
main job) needs none of them.

No torch here: validation asks before anything heavy is imported.
"""

from __future__ import annotations

import importlib.util

from memtrain.errors import ConfigError

EXTRAS = {
    "speech": ("espeakng_loader", "soxr", "soundfile", "jiwer"),
    "tracking": ("tensorboard",),
    "datasets": ("datasets",),
    "lora": ("peft",),
}
"""Extra → the modules it installs (``pyproject.toml``'s ``[project.optional-dependencies]``)."""


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` this Python cannot import (not installed)."""
    out = []
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(module)
    return out


def require(extra: str, field: str, what: str) -> None:
    """Raise unless every module of ``extra`` is installed.

    Args:
        extra: a key of :data:`EXTRAS`.
        field: the setting the error names (``data.kind``, ``logging.log_with``, ``data.files``).
        what: the feature, for the message (``speech data``).

    Raises:
        ConfigError: ``field``: ``what`` needs ``memtrain[extra]``, with the missing modules and
            the command that installs them.
    """
    absent = missing(extra)
    if absent:
        raise ConfigError(field, f"{what} needs memtrain's {extra} extra ({', '.join(absent)} not installed): "
                          f"pip install 'memtrain[{extra}]' (or, in a clone, pip install -e '.[{extra}]')")
