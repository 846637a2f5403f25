"""``python -m memtrain.levers``: write the levers' declarations into the config and the docs of
this source checkout (:mod:`memtrain.levers.generated`), after a lever was added or changed.
Prints each file it rewrote; ``--check`` writes nothing and exits 1 when one is stale."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memtrain.levers.generated import rewrites, stale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memtrain.levers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is stale")
    opts = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        parser.error(f"{root} is not a source checkout (no pyproject.toml): nothing to rewrite")
    changed = stale(root)
    for rel in changed:
        print(f"{rel}: {'stale' if opts.check else 'rewritten'}")
        if not opts.check:
            path = root / rel
            path.write_text(rewrites()[rel](path.read_text()))
    return 1 if opts.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
