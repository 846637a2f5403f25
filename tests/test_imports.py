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


def _parents(tree: ast.AST) -> dict:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _in_function(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
    return False


def test_memtrain_imports_are_at_the_top_unless_heavy():
    """A memtrain module is imported inside a function only where importing it at the top would
    load a heavy dependency early (``memtrain --help`` without torch), at most 15 times, each with
    its reason on the line (docs/design.md, "Modules and their owners")."""
    inner = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        lines, tree = text.splitlines(), ast.parse(text)
        parents = _parents(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and _in_function(node, parents):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if getattr(node, "level", 0) or any(n.split(".")[0] == "memtrain" for n in names):
                    inner.append((f"{path.relative_to(PACKAGE)}:{node.lineno}", lines[node.end_lineno - 1]))
    assert len(inner) <= 15, inner
    assert all("#" in line for _, line in inner), [where for where, line in inner if "#" not in line]


ENGINE_NAMES = {"ddp", "fsdp", "deepspeed"}


def test_engine_names_are_compared_only_by_the_engines():
    """Outside backends/ and the config, code asks an engine's module what it can do instead of
    comparing engine names (one comparison: the launcher's mapping of Accelerate's settings to
    engines)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("backends/") or rel == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in ENGINE_NAMES
                    for side in (node.left, *node.comparators) for c in ast.walk(side)):
                found.append(f"{rel}:{node.lineno}")
    assert len(found) <= 1 and all(f.startswith("launcher.py:") for f in found), found


def calls_of(function: str) -> list[str]:
    """``file:line`` of every call of ``function`` (by its name) in the package."""
    return [f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}" for path in PACKAGE.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
            and function in (getattr(node.func, "id", None), getattr(node.func, "attr", None))]


def test_the_engine_is_resolved_and_the_deepspeed_json_read_in_one_place():
    """Every command resolves its ``backend`` section through one call
    (``run_placement.configured_spec``), and the user's DeepSpeed JSON has one reader
    (``spec.configured_engine``), which validation calls too."""
    resolves, reads = calls_of("resolve_engine"), calls_of("read_user_json")
    assert len(resolves) == 1 and resolves[0].startswith("planning/run_placement.py:"), resolves
    assert len(reads) == 1 and reads[0].startswith("backends/spec.py:"), reads
    assert len(calls_of("configured_spec")) == 3, calls_of("configured_spec")  # the run, memtrain plan|memory, --print_config


def test_no_engine_imports_a_checkpoint_format():
    """An engine writes through the format it is handed (``make_backend``: its ``checkpoint_io``);
    no module of backends/ imports a format's module (the package's ``CheckpointState`` and
    registry are the interface; the model kinds its ``CHECKPOINT_MODEL`` names)."""
    import memtrain.checkpoint.formats as package

    kinds = [name for name, value in vars(package).items() if isinstance(value, str) and value in package.MODEL_KINDS]
    assert len(kinds) == len(package.MODEL_KINDS)
    modules = module_names()
    formats = {m for m in modules if m.startswith("memtrain.checkpoint.formats.")}
    assert formats, "no format modules found"
    found = [f"{name} → {dep}" for name, path in modules.items() if name.startswith("memtrain.backends")
             for dep in imports_of(name, path, modules) if dep in formats]
    for engine in ENGINE_NAMES:  # nor takes one from the registry by name
        tree = ast.parse((PACKAGE / "backends" / f"{engine}.py").read_text())
        found += [f"{engine}: {a.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and (node.module or "").startswith("memtrain.checkpoint") for a in node.names
                  if a.name not in ("CheckpointState", *kinds)]
        found += [f"{engine}: import {a.name}" for node in ast.walk(tree) if isinstance(node, ast.Import)
                  for a in node.names if a.name.startswith("memtrain.checkpoint")]
    assert not found, found


def test_a_plan_reaches_the_engine_in_one_place():
    """``Backend.set_plan`` is called from one function (the model transforms' ``apply_plan``)."""
    calls = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "set_plan"]
    assert len(calls) == 1 and calls[0].startswith("transforms.py:"), calls


LOWER_LAYERS = {
    "memtrain.memory": ("memtrain.backends", "memtrain.planning", "memtrain.levers", "memtrain.checkpoint",
                        "memtrain.oom", "memtrain.loop"),
    "memtrain.checkpoint": ("memtrain.backends", "memtrain.planning", "memtrain.levers", "memtrain.oom",
                            "memtrain.loop"),
}
"""Packages and what they must not import: the memory accounting and the checkpoint layer sit below
the engines, the levers and the planners, which read them."""


def test_no_import_runs_back_up():
    """The accounting and the checkpoint layer import no engine, lever, planner or the loop (the
    levers' resume rules reach the checkpoint layer as data: ``ResumeRules.with_levers``)."""
    modules = module_names()
    found = [f"{name} → {dep}" for name, path in modules.items() for package, above in LOWER_LAYERS.items()
             if name == package or name.startswith(package + ".")
             for dep in imports_of(name, path, modules) if dep.startswith(above)]
    assert not found, found


def test_engine_names_are_listed_only_by_the_registry():
    """No tuple, list or set of engine names outside backends/, the registry
    (``memtrain/engine_names.py``) and the config: a new engine is one registry line."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("backends/") or rel in ("config.py", "engine_names.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and sum(
                    isinstance(e, ast.Constant) and e.value in ENGINE_NAMES for e in node.elts) >= 2:
                found.append(f"{rel}:{node.lineno}")
    assert not found, found


def test_an_engine_is_checked_when_registered(monkeypatch):
    """An engine module that misses a name the planner, the validation or the OOM message asks for
    fails at registration, naming it; the real engines pass, and the config's choices are the
    registry's."""
    import types
    import typing

    import pytest

    import memtrain.backends as backends
    from memtrain.backends.engine import check_engine
    from memtrain.config import BackendConfig
    from memtrain.engine_names import ENGINES

    for name in ENGINES:
        assert backends.engine_module(name).__name__ == f"memtrain.backends.{name}"
    ddp = backends.engine_module("ddp")
    partial = types.ModuleType("memtrain.backends.partial")
    partial.__dict__.update({k: v for k, v in vars(ddp).items() if k not in ("AUTOCAST_MIXED_PRECISION", "stop_words")})
    with pytest.raises(TypeError, match="engine 'partial'.*AUTOCAST_MIXED_PRECISION, stop_words"):
        check_engine(partial, "partial")
    partial.AUTOCAST_MIXED_PRECISION, partial.stop_words = True, ddp.stop_words
    partial.VARIANTS = backends.engine_module("fsdp").VARIANTS  # offloading placements ask for more
    with pytest.raises(TypeError, match="offload_ratio, offload_seconds"):
        check_engine(partial, "partial")
    partial.offload_ratio, partial.offload_seconds = ddp.stop_words, ddp.stop_words  # any callables
    partial.VARIANTS = backends.engine_module("deepspeed").VARIANTS  # NVMe placements ask whether files can run
    with pytest.raises(TypeError, match="does not define nvme_available"):
        check_engine(partial, "partial")
    partial.VARIANTS, partial.CHECKPOINT_MODEL = ddp.VARIANTS, "sharded_module"  # safetensors saves no sharded module
    with pytest.raises(TypeError, match="engine 'partial': its CHECKPOINT_FORMAT 'safetensors' does not save"):
        check_engine(partial, "partial")
    partial.CHECKPOINT_MODEL = "pieces"
    with pytest.raises(TypeError, match="CHECKPOINT_MODEL 'pieces' is not one of whole_module, sharded_module"):
        check_engine(partial, "partial")
    monkeypatch.setattr(backends, "_CHECKED", {})  # the registry checks a module it loads
    monkeypatch.delattr(ddp, "AUTOCAST_MIXED_PRECISION")
    with pytest.raises(TypeError, match="engine 'ddp'.*AUTOCAST_MIXED_PRECISION"):
        backends.engine_module("ddp")
    hints = typing.get_type_hints(BackendConfig)
    assert typing.get_args(hints["name"]) == ("auto", *ENGINES)


def test_the_config_imports_no_torch():
    """The config (and so ``memtrain --help``) loads without torch: the levers' fields are written
    into it as source (memtrain/levers/generated.py), not read from the levers when it is imported."""
    import subprocess
    import sys

    probe = "import sys, memtrain.config, memtrain.train; print(sorted(m for m in ('torch', 'memtrain.levers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


LEVER_FIELD_READERS = {"backends/fsdp.py", "estimate.py", "launcher.py", "planning/placement.py",
                       "planning/run_placement.py"}
"""The modules outside levers/ and config.py that read a lever's config field: FSDP2 builds its
optimizer with the state dtype; ``memtrain plan`` and the placement planner choose the state dtype
(lossy only with ``memory.allow_lossy_levers``) before a model is built; the launcher maps
Accelerate's FSDP settings onto the config's."""


def test_a_levers_config_fields_are_read_by_at_most_six_modules_outside_levers():
    """A lever's config fields (its ``config_key`` and its declared ``memory`` fields, from the
    registry: a new lever's are counted) are read as ``<config>.<section>.<field>`` in at most six
    modules outside levers/ and config.py: the planner, validation and the trace ask the lever
    (its ``validate``, ``block_period``, ``copy_bytes_per_s``), not the config."""
    from memtrain.levers import LEVERS

    fields = {tuple(x.config_key.split(".")) for x in LEVERS}
    fields |= {("memory", f.name) for x in LEVERS for f in x.config_fields}
    fields.add(("memory", "allow_lossy_levers"))
    readers = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("levers/") or rel == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and (node.value.attr, node.attr) in fields):
                readers.add(rel)
    assert readers <= LEVER_FIELD_READERS and len(LEVER_FIELD_READERS) <= 6, sorted(readers)
