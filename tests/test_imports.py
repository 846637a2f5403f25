"""The package's import graph has no cycle, counting imports inside functions too (docs/design.md,
"Modules and their owners"): data flows one way."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "memtrain"


def module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The memtrain modules ``name`` imports anywhere in its text (``from pkg import sub`` counts as
    importing ``pkg.sub`` when that is a module, else ``pkg``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names} & set(modules)
            found |= subs if subs and len(subs) == len(node.names) else {base} | subs
    return {m for m in found if m in modules and m != name}


def test_no_import_cycle():
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " → ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_walker_sees_imports_inside_functions(tmp_path):
    """The walker sees an import inside a function (the kind that hid the last cycle)."""
    (tmp_path / "a.py").write_text("def f():\n    from memtrain import b\n")
    (tmp_path / "b.py").write_text("import memtrain.a\n")
    modules = {"memtrain.a": tmp_path / "a.py", "memtrain.b": tmp_path / "b.py"}
    assert imports_of("memtrain.a", modules["memtrain.a"], modules) == {"memtrain.b"}
    assert imports_of("memtrain.b", modules["memtrain.b"], modules) == {"memtrain.a"}
