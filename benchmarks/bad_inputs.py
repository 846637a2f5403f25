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
DROP_OUTPUTS = "_drop_outputs"
"""A case's environment key: its copy of the run has no ``model/`` and no ``summary.json`` (what a
final export that failed leaves)."""
FROM_OUTSIDE = str(REPO / "tests" / "from_outside.py")
"""``memtrain`` with a failure from outside (a full disk in the export or the data cache)."""
NONE_MODEL = """import sys, torch, memtrain
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(512, 8)
    def forward(self, input_ids):
        self.emb(input_ids)  # no return
torch.manual_seed(0)
memtrain.Trainer(model=Model(), args=sys.argv[1:]).fit()
"""


def without_model(args: list[str]) -> list[str]:
    """``--key value`` pairs without the ``--model.config.*`` ones (a Python model replaces them)."""
    pairs = zip(args[::2], args[1::2])
    return [a for key, value in pairs if not key.startswith("--model.config.") for a in (key, value)]


def user_files(tmp: Path, base: Path) -> None:
    """The user's own folders and files the cases of issue "nothing of the user's overwritten" use."""
    hf = tmp / "my_hf_model"  # a transformers model of the user's: an export's files, no marker
    shutil.copytree(base / "model", hf)
    (hf / "memtrain_export.json").unlink()
    (tmp / "my_config").mkdir()
    write(tmp / "my_config" / "config.json", '{"model_type": "mine"}\n')
    (tmp / "my_results").mkdir()
    write(tmp / "my_results" / "metrics.jsonl", '{"step": 1, "accuracy": 0.93}\n')
    shutil.copytree(base / "model", tmp / "earlier_export")  # an export, and a link to it
    os.symlink(tmp / "earlier_export", tmp / "export_link")
    (tmp / "empty_target").mkdir()
    os.symlink(tmp / "empty_target", tmp / "empty_link")
    line = "def f(x):\n    return x + 1  # a line of code\n"
    write(tmp / "big.txt", line * (8_000_000 // len(line)))
    write(tmp / "small.txt", line * (20_000 // len(line)))
    write(tmp / "nulls.jsonl", '{"text": "def f(): pass"}\n{"text": null}\n' * 50)
    write(tmp / "more.jsonl", '{"text": "def g(): return 1"}\n' * 100)
    write(tmp / "none_model.py", NONE_MODEL)



def cases(tmp: Path, run: Path) -> list[tuple[str, list[str], dict]]:
    """(what the user did, the command after ``memtrain`` — or a script and its arguments —,
    extra environment); the user's folders and files of :func:`user_files` exist."""
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
        ("a misspelt model.config key", [*train, "--model.config.n_layr", "2"], {}),
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
        ("export into a folder holding the user's transformers model (no memtrain marker)",
         ["export", r, str(tmp / "my_hf_model")], {}),
        ("export into a folder holding only the user's config.json", ["export", r, str(tmp / "my_config")], {}),
        ("export into a link to an earlier export", ["export", r, str(tmp / "export_link")], {}),
        ("export into a link to an empty folder", ["export", r, str(tmp / "empty_link")], {}),
        ("export with --max_shard_size abc", ["export", r, str(tmp / "new_export"), "--max_shard_size", "abc"], {}),
        ("output_dir holding the user's own metrics.jsonl", [*train, "--output_dir", str(tmp / "my_results")], {}),
        ("an 8 MB and a 20 KB data file", [*train, "--output_dir", str(tmp / "two_files"), "--data.files",
                                           f"[{tmp / 'big.txt'},{tmp / 'small.txt'}]", "--data.max_bytes", "0",
                                           "--training.max_steps", "1"], {}),
        ('JSONL rows with "text": null', [*train, "--output_dir", str(tmp / "nulls_run"), "--data.files",
                                          f"[{tmp / 'nulls.jsonl'},{tmp / 'more.jsonl'}]", "--data.max_bytes", "0"], {}),
        ("the disk fills during the final export (ENOSPC injected)",
         [FROM_OUTSIDE, *train[1:], "--output_dir", str(tmp / "export_fails")], {"MEMTRAIN_DISK_FULL_IN": "export"}),
        ("rerun a run whose final export failed", train, {DROP_OUTPUTS: "1"}),
        ("the data cache's disk fills (ENOSPC injected)", [FROM_OUTSIDE, *train[1:], "--output_dir", str(tmp / "cache_run")],
         {"MEMTRAIN_DISK_FULL_IN": "cache", "MEMTRAIN_CACHE": str(tmp / "full_cache")}),
        ("memory.host_memory_gib 0.001 with micro_batch_size auto",
         [*train, "--output_dir", str(tmp / "tiny_host"), "--training.micro_batch_size", "auto",
          "--memory.host_memory_gib", "0.001"], {}),
        ("a Python model whose forward returns None",
         [str(tmp / "none_model.py"), *without_model(TINY), "--model.config", "{}", "--output_dir",
          str(tmp / "none_run")], {}),
    ]


WATCHED = ("notes", "my_hf_model", "my_config", "my_results", "earlier_export", "empty_target")
"""The user's folders whose files a case must not change (besides the run's copy); an export into
a link changes the folder it points at, as asked."""


def restore_user_files(tmp: Path, base: Path) -> None:
    """The link targets as they were before a case exported into them."""
    for target in ("earlier_export", "empty_target"):
        shutil.rmtree(tmp / target, ignore_errors=True)
    shutil.copytree(base / "model", tmp / "earlier_export")
    (tmp / "empty_target").mkdir()


def message_of(proc: subprocess.CompletedProcess) -> str:
    """The line memtrain said most about the case (its error, else its last warning)."""
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip().startswith("memtrain")]
    errors = [ln for ln in lines if ln.startswith(("memtrain: config error", "memtrain export:", "memtrain: checkpoint",
                                                   "memtrain: exporting", "memtrain.errors."))]
    said = [ln for ln in lines if any(w in ln for w in ("changed settings", "already", "past", "finished training",
                                                         "predicted to fit"))]
    started = [ln for ln in lines if "held out for validation" in ln]  # the start line: how the data was split
    chosen = (errors or said or started or lines or ["(nothing)"])[-1]
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
    parser.add_argument("--only", help="the cases whose description holds this text (no --write)")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="memtrain-bad-inputs-"))
    rows = []
    try:
        cache = str(scratch / "cache")
        base = base_run(scratch, cache)
        user_files(scratch, base)
        for what, command, env in cases(scratch, scratch / "run_template"):
            if (args.quick and what not in QUICK) or (args.only and args.only not in what):
                continue
            run = scratch / "run_template"
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(base, run)
            env = dict(env)
            if env.pop(DROP_CHECKPOINTS, None):
                shutil.rmtree(run / "checkpoints")
            if env.pop(DROP_OUTPUTS, None):
                shutil.rmtree(run / "model")
                (run / "summary.json").unlink()
            watched = [run, *[scratch / n for n in WATCHED]]
            before = [snapshot(w) for w in watched]
            cmd = [sys.executable, "-m", "memtrain.export", *command[1:]] if command[0] == "export" else [
                sys.executable, *command, "--data.cache_dir", cache]
            if "MEMTRAIN_CACHE" in env:
                cmd = cmd[:-2]  # the variable, not data.cache_dir, names the cache
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", **env})
            changed = [{"run_template": "the run"}.get(w.name, w.name) for w, b in zip(watched, before)
                       if snapshot(w) != b]
            restore_user_files(scratch, base)
            rows.append({"case": what, "exit_code": proc.returncode,
                         "message": message_of(proc).replace(str(scratch) + "/", "").replace("run_template", "RUN"),
                         "files_changed": changed})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.write and not args.quick and not args.only:
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
