"""Bad and careless inputs tried as a new user would, each through the real command line: its
exit code, what memtrain says, and whether any file of the user's or of the run changed.

    python benchmarks/bad_inputs.py            # JSON rows on stdout
    python benchmarks/bad_inputs.py --write    # and regenerate docs/bad_inputs.md
    python benchmarks/bad_inputs.py --quick    # four cases (QUICK)

Every case starts from a copy of one finished 4-step run of the tiny model (checkpoints at steps 2
and 4), in a scratch folder; the table in docs/bad_inputs.md is this script's output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, TINY_ARGS, TRAIN  # noqa: E402

TINY = TINY_ARGS + ["--training.max_steps", "4", "--checkpoint.every_steps", "2", "--training.lr", "1e-3"]


def snapshot(folder: Path) -> dict[str, str]:
    """Relative path → sha256 of every file below ``folder`` (the run lock's own file aside)."""
    out = {}
    for base, _, names in os.walk(folder):
        for name in names:
            if name != ".memtrain.lock":
                path = os.path.join(base, name)
                out[os.path.relpath(path, folder)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


def write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_text(text, encoding=encoding)
    return path


QUICK = ("export a run into its own folder", "rerun a finished run", "rerun a finished run that saved no checkpoint",
         "a recipe giving the training section twice")
"""The cases of ``--quick``."""
DROP_CHECKPOINTS = "_drop_checkpoints"
"""A case's environment key: its copy of the run has no checkpoints (``checkpoint.every_steps 0``)."""


def cases(tmp: Path, run: Path) -> list[tuple[str, list[str], dict]]:
    """(what the user did, the command after ``memtrain``, extra environment)."""
    notes = tmp / "notes"
    notes.mkdir()
    write(notes / "ideas.txt", "mine")
    text = "def add(a, b):\n    return a + b  # la somme\n" * 400
    write(tmp / "a.py", text)
    write(tmp / "b.py", text.replace("somme", "s\u00f6mme\u00e9"), "latin-1")
    write(tmp / "only.txt", text)
    write(tmp / "twice.yaml", (REPO / "recipes" / "code_lm_tiny.yaml").read_text() + "training:\n  max_steps: 3\n")
    write(tmp / "commented.json", '{\n  // ZeRO-2\n  "zero_optimization": {"stage": 2}\n}\n')
    write(tmp / "trailing.json", '{\n  "zero_optimization": {"stage": 2},\n}\n')
    write(tmp / "fp16.json", '{"fp16": {"enabled": true}, "zero_optimization": {"stage": 2}}\n')
    write(tmp / "a_file", "x")
    write(tmp / "typo.yaml", "training:\n  max_stepz: 3\n")
    r, train = str(run), [TRAIN, *TINY, "--output_dir", str(run)]
    return [
        ("export into a folder holding the user's notes", ["export", r, str(notes)], {}),
        ("export a run into its own folder", ["export", r, r], {}),
        ("export into a folder inside the run", ["export", r, str(run / "exported")], {}),
        ("resume with a changed training.lr", [*train, "--training.max_steps", "5", "--training.lr", "3e-3"], {}),
        ("resume with a changed training.seed", [*train, "--training.max_steps", "5", "--training.seed", "7"], {}),
        ("rerun a finished run", train, {}),
        ("rerun a finished run with a lower max_steps", [*train, "--training.max_steps", "2"], {}),
        ("rerun a finished run that saved no checkpoint", train, {DROP_CHECKPOINTS: "1"}),
        ("a mistyped subcommand", [TRAIN, "trian", *train[1:]], {}),
        ("a recipe with a mistyped key", [*train, "--config", str(tmp / "typo.yaml")], {}),
        ("precision fp8", [*train, "--precision", "fp8"], {}),
        ("a recipe giving the training section twice", [*train, "--config", str(tmp / "twice.yaml")], {}),
        ("a latin-1 data file read as utf-8", [*train, "--resume", "never", "--data.files", f"[{tmp}/*.py]",
                                                "--data.max_bytes", "0"], {}),
        ("checkpoint.max_shard_size abc", [*train, "--checkpoint.max_shard_size", "abc"], {}),
        ("a single data file", [*train, "--resume", "never", "--data.files", f"[{tmp / 'only.txt'}]",
                                "--data.max_bytes", "0"], {}),
        ("model.config.n_layer four", [*train, "--model.config.n_layer", "four"], {}),
        ("n_embd 100 with n_head 3", [*train, "--model.config.n_embd", "100", "--model.config.n_head", "3"], {}),
        ("an unknown model_type", [*train, "--model.config.model_type", "gtp2"], {}),
        ("a DeepSpeed JSON with a comment", [*train, "--backend.deepspeed_config", str(tmp / "commented.json")], {}),
        ("a DeepSpeed JSON with a trailing comma", [*train, "--backend.deepspeed_config", str(tmp / "trailing.json")], {}),
        ("a DeepSpeed JSON with fp16 on the CPU, precision auto",
         [*train, "--precision", "auto", "--backend.deepspeed_config", str(tmp / "fp16.json")], {}),
        ("MEMTRAIN_CACHE that cannot be written", [*train, "--resume", "never"],
         {"MEMTRAIN_CACHE": str(tmp / "a_file" / "cache")}),
        ("--training.learning_rate (HF Trainer's name)", [*train, "--training.learning_rate", "1e-4"], {}),
        ("--bf16 true (HF Trainer's flag)", [*train, "--bf16", "true"], {}),
    ]


def message_of(proc: subprocess.CompletedProcess) -> str:
    """The line memtrain said most about the case (its error, else its last warning)."""
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip().startswith("memtrain")]
    errors = [ln for ln in lines if ln.startswith(("memtrain: config error", "memtrain export:", "memtrain: checkpoint"))]
    chosen = (errors or [ln for ln in lines if "changed settings" in ln or "already" in ln or "past" in ln] or
              lines or ["(nothing)"])[-1]
    return chosen if len(chosen) <= 400 else chosen[:397] + "…"


def base_run(folder: Path, cache: str) -> Path:
    run = folder / "base"
    subprocess.run([sys.executable, TRAIN, *TINY, "--output_dir", str(run), "--data.cache_dir", cache], check=True,
                   capture_output=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="four cases only (QUICK)")
    parser.add_argument("--write", action="store_true", help="regenerate docs/bad_inputs.md")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="memtrain-bad-inputs-"))
    rows = []
    try:
        cache = str(scratch / "cache")
        base = base_run(scratch, cache)
        for what, command, env in cases(scratch, scratch / "run_template"):
            if args.quick and what not in QUICK:
                continue
            run = scratch / "run_template"
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(base, run)
            env = dict(env)
            if env.pop(DROP_CHECKPOINTS, None):
                shutil.rmtree(run / "checkpoints")
            watched = [run, scratch / "notes"]
            before = [snapshot(w) for w in watched]
            cmd = [sys.executable, "-m", "memtrain.export", *command[1:]] if command[0] == "export" else [
                sys.executable, *command, "--data.cache_dir", cache]
            if "MEMTRAIN_CACHE" in env:
                cmd = cmd[:-2]  # the variable, not data.cache_dir, names the cache
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", **env})
            changed = [{"run_template": "the run"}.get(w.name, w.name) for w, b in zip(watched, before)
                       if snapshot(w) != b]
            rows.append({"case": what, "exit_code": proc.returncode,
                         "message": message_of(proc).replace(str(scratch) + "/", "").replace("run_template", "RUN"),
                         "files_changed": changed})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.write and not args.quick:
        (REPO / "docs" / "bad_inputs.md").write_text(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    out = ["# Bad and careless inputs", "",
           "Generated by `python benchmarks/bad_inputs.py --write`: each input run through the real command line",
           "on a copy of a finished 4-step run of the tiny model. *Files changed* lists the watched folders",
           "(the run, a folder of the user's notes) whose files differ afterwards: a resume that trains",
           "changes the run, as it should; nothing else may change anything.", "",
           "| input | exit | what memtrain says | files changed |", "|---|---|---|---|"]
    for r in rows:
        message = r["message"].replace("|", "\\|")
        out.append(f"| {r['case']} | {r['exit_code']} | {message} | {', '.join(r['files_changed']) or 'none'} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
