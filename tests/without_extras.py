"""Run a script as if memtrain were installed with ``pip install -e .`` alone, without its extras
(``pyproject.toml``: speech, tracking, datasets, lowbit): their modules, and the ones they bring
(pandas, pyarrow), are not found on ``sys.path``, for imports and for libraries' availability
checks alike. Modules imported before this runs are not affected: start it as its own process.

    python tests/without_extras.py memtrain/train.py --config ...
"""
import importlib.machinery
import runpy
import sys

BLOCKED = {"datasets", "pandas", "pyarrow", "tensorboard", "soundfile", "soxr", "jiwer", "espeakng_loader", "torchao"}
_find = importlib.machinery.PathFinder.find_spec.__func__


def find_spec(cls, name, path=None, target=None):
    """sys.path's finder, which does not find the extras' modules."""
    return None if name.split(".")[0] in BLOCKED else _find(cls, name, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(find_spec)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
