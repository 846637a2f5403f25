"""The front door: README.md stays short, its two set-up commands are the ones CI and a newcomer
run, and every link in README.md and docs/ points at a file and heading that exist."""

import json
import re
from pathlib import Path

import pytest

from conftest import REPO, launch, run_cli

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def fenced_blocks(text: str, language: str = "bash") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = [block.strip() for block in fenced_blocks(setup)]
    assert len(commands) == 2, commands
    train, tests = commands
    # the test command is the one CI runs, verbatim
    ci = (REPO / ".ci" / "run").read_text()
    assert tests in ci, (tests, ci)
    # the main job: installs, then trains a recipe that exists
    assert train.startswith("pip install -e . && python memtrain/train.py --config ")
    recipe = train.split("--config ", 1)[1].split()[0]
    assert (REPO / recipe).is_file()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    links = [a or b for a, b in LINK.findall(text)]
    assert "../shared" not in page.read_text()
    for link in links:
        if re.match(r"[a-z]+://", link) or link.startswith("mailto:"):
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: {link} -> {path}"
        if anchor:
            assert anchor in anchors(path), f"{page.name}: #{anchor} is not a heading of {path.name}"


@pytest.mark.slow
@pytest.mark.heavy
def test_the_python_page_runs_as_written(tmp_path):
    """docs/python.md's program and commands, as written but for ``runs/`` (a temporary folder):
    each exits 0; the program's and the examples' validation losses fall; the exported model
    the last command fine-tunes is the third command's."""
    import os
    import shlex
    import sys

    page = (REPO / "docs" / "python.md").read_text()
    program, = fenced_blocks(page, "python")
    commands, = fenced_blocks(page, "bash")
    runs = f"{tmp_path}/runs/"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                                           os.environ["PATH"]])}
    script = tmp_path / "quickstart.py"
    script.write_text(program.replace("runs/", runs))
    outputs = [run_cli([], script=script, timeout=240)]
    for line in commands.strip().splitlines():
        outputs.append(run_documented(shlex.split(line.replace("runs/", runs)), REPO, env, timeout=300))
        assert outputs[-1].returncode == 0, (line, outputs[-1].stderr[-4000:])
    assert outputs[0].returncode == 0, outputs[0].stderr[-4000:]
    for out in (outputs[0], outputs[1], outputs[2], outputs[3], outputs[5], outputs[6]):  # the program and the scripts
        first, last = map(float, re.search(r"validation loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
        assert last < first, out.stdout[-2000:]
    for out in (outputs[1], outputs[2]):  # the example's compute_metrics, one rank and ZeRO-3 on two
        first, last = map(float, re.search(r"validation accuracy ([\d.]+) -> ([\d.]+)", out.stdout).groups())
        assert 0 <= first < last <= 1, out.stdout[-2000:]
    assert (tmp_path / "runs" / "code_lm_small_finetune" / "model" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "code_lm_small_finetune" / "model" / "tokenizer.json").is_file()  # the tokenizer handed over
    trained, total = (int(n.replace(",", "")) for n in re.search(r"([\d,]+) of ([\d,]+) parameters trained",
                                                                 outputs[6].stdout).groups())
    assert 0 < trained < total / 50  # the LoRA example's adapters only
    said = re.findall(r"step (\d+): validation accuracy ([\d.]+), lr ([\d.e-]+)", outputs[3].stdout)  # own_optimizer.py
    # the rate step s ran with: StepLR stepped s - 1 times before it
    rates = [3e-3 * 0.5 ** ((int(step) - 1) // 40) for step, _, _ in said]
    assert [float(lr) for _, _, lr in said] == pytest.approx(rates)
    assert float(said[-1][1]) > 0.9 and "stopped early" in outputs[3].stdout  # EarlyStopping ended it
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "runs" / "code_lm_small_lora" / "model"))
    assert sum(p.numel() for p in merged.parameters()) == total - trained  # merged: no adapter left


# The pages in the order the README's table sends a reader through them, the README first.
ORDER = ["README.md", "docs/engines.md", "docs/memory.md", "docs/checkpoints.md", "docs/configuration.md",
         "docs/python.md", "docs/operations.md", "docs/speech.md", "docs/benchmarks.md", "docs/bad_inputs.md",
         "docs/design.md"]
# Documented commands this machine cannot run as a user would: what marks them, and why.
NOT_RUN_HERE = {
    "pytest": "the test suite itself",
    "benchmarks/": "benchmarks: tests/test_benchmarks.py runs their plumbing",
    "HOST0": "several machines",
    "--hostfile": "several machines",
    "examples/": "test_the_python_page_runs_as_written runs them and checks their losses",
    "--output_dir runs/code_lm_small": "docs/python.md's run for its fine-tuning example: "
                                       "test_the_python_page_runs_as_written runs it as written",
    "accelerate launch": "tests/test_ddp.py and tests/test_backends.py run accelerate launch as documented (without a "
                         "config file, with fsdp2.yaml, with deepspeed_zero2.yaml) and compare the losses with DDP's",
    "deepspeed --num_gpus": "tests/test_backends.py runs the DeepSpeed launcher with ds_configs/zero2.json and compares "
                            "the losses with DDP's",
    "train.py --config recipes/code_lm_350m.yaml": "training 355M parameters needs a GPU (its `memtrain plan` runs)",
}


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every shell command of the README and docs/, in reading order: ``(page, argv)``, with line
    continuations joined, comments dropped and a leading ``pip install … &&`` removed."""
    import shlex

    commands = []
    assert sorted(ORDER) == sorted(str(p.relative_to(REPO)) for p in PAGES)
    for page in ORDER:
        for block in fenced_blocks((REPO / page).read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                argv = shlex.split(line, comments=True)
                if "&&" in argv:
                    argv = argv[len(argv) - argv[::-1].index("&&"):]
                if argv:
                    commands.append((page, argv))
    return commands


def _runs_here(argv: list[str]) -> bool:
    line = " ".join(argv)
    return not any(mark in line for mark in NOT_RUN_HERE)


def _trains(argv: list[str]) -> bool:
    return any(a.endswith("train.py") for a in argv) or argv[:2] == ["memtrain", "--config"]


def _output_dir(argv: list[str]) -> str | None:
    """The folder a training command writes: its ``--output_dir``, else its recipe's."""
    import yaml

    if "--output_dir" in argv:
        return argv[argv.index("--output_dir") + 1]
    return yaml.safe_load((REPO / argv[argv.index("--config") + 1]).read_text())["output_dir"]


def run_documented(argv: list[str], cwd: Path, env: dict, timeout: float):
    """Run a documented command in ``cwd``: ``python SCRIPT …`` and ``memtrain …`` (the console
    script runs ``memtrain/train.py``'s ``cli``) as one process forked by the test's fork server
    (the imports done once), ``torchrun --nproc_per_node N SCRIPT …`` as N ranks forked by it with
    torchrun's environment (the suite's torchrun stand-in), other commands (an environment
    variable first) through the shell as written."""
    import shlex
    import subprocess

    if argv[0] == "torchrun" and argv[1] == "--nproc_per_node" and argv[3].endswith(".py"):
        return launch(argv[4:], nproc=int(argv[2]), script=str(cwd / argv[3]), cwd=cwd, env=env, timeout=timeout,
                      check=False)
    if argv[0] == "python" and argv[1].endswith(".py"):
        return run_cli(argv[2:], script=cwd / argv[1], cwd=cwd, env=env, timeout=timeout)
    if argv[0] == "memtrain":
        return run_cli(argv[1:], cwd=cwd, env=env, timeout=timeout)
    try:
        return subprocess.run(shlex.join(argv), shell=True, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"timed out after {timeout}s: {shlex.join(argv)}\n{exc.stdout}\n{exc.stderr}")


def test_no_two_documented_runs_share_a_folder():
    """A reader who runs the docs in order never resumes (or is refused by) another command's run:
    two training commands write one folder only when they are the same command (the second
    resumes the first, as docs/checkpoints.md shows)."""
    writers: dict[str, set[str]] = {}
    for page, argv in documented_commands():
        if _trains(argv):
            script = next(i for i, a in enumerate(argv) if a.endswith(".py") or a == "memtrain")
            writers.setdefault(_output_dir(argv), set()).add(" ".join(argv[script:]))  # launcher aside
    shared = {folder: runs for folder, runs in writers.items() if len(runs) > 1}
    assert not shared, shared


@pytest.mark.slow
@pytest.mark.heavy
def test_the_documented_commands_run_in_order(tmp_path):
    """Every command of the README and docs/ that this CPU machine can run, run in the docs' order
    in one folder as a reader would (``runs/`` shared; training shortened with
    ``--training.max_steps 2 --training.eval_samples 8``, the speech recipe's synthetic corpus to 128
    training utterances -- 4,000 take 70 s of CPU -- ; ``my_corpus/`` and ``my_dataset_on_disk`` made): each exits 0,
    including the launchers' own commands (torchrun, accelerate launch, deepspeed). A training
    command that, so shortened, differs from one already run only by its new ``--output_dir``
    trains nothing new and is not run again (the README's tiny run is documented three times)."""
    import os
    import shlex
    import sys

    import datasets

    for name in ("memtrain", "recipes", "ds_configs", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    texts = [p.read_text() for p in sorted(Path(os.__file__).parent.glob("[a-m]*.py"))[:40]]
    (tmp_path / "my_corpus").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "my_corpus" / f"{i}.txt").write_text(text)
    rows = [text[i:i + 2000] for text in texts for i in range(0, len(text), 2000)]  # ~575: rows on both sides of the hash split
    datasets.Dataset.from_dict({"content": rows}).save_to_disk(str(tmp_path / "my_dataset_on_disk"))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    ran, seen = [], set()
    for page, argv in documented_commands():
        if not _runs_here(argv):
            continue
        if _trains(argv) and "--resume" not in argv and not (tmp_path / _output_dir(argv)).exists():
            key = tuple(a for i, a in enumerate(argv) if not ({a, argv[i - 1]} & {"--output_dir", "--training.max_steps"}))
            if key in seen:
                ran.append(argv)
                continue
            seen.add(key)
        if _trains(argv):
            argv = argv + ["--training.max_steps", "2", "--training.eval_samples", "8"]
            if "recipes/asr_ctc_wavlm_tiny.yaml" in argv:  # 2 steps read 64 utterances: synthesise 128, not 4,000
                argv += ["--data.speech.train_utterances", "128", "--data.speech.test_utterances", "8"]
        proc = run_documented(argv, tmp_path, env, timeout=420)
        if proc.returncode != 0:  # the whole message (an assert's would be cut short)
            pytest.fail(f"{page}: {shlex.join(argv)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        ran.append(argv)
    assert (tmp_path / "runs" / "tiny_ckpt" / "model" / "model.safetensors").is_file()
    assert (tmp_path / "exports" / "tiny_ckpt" / "model.safetensors").is_file()
    assert len(ran) >= 15, ran


CITED_COMMIT = re.compile(r"(?<![\w/.#-])([0-9a-f]{7,40})(?![\w.-])")


def _row_commits() -> set[str]:
    commits = set()
    for path in (REPO / "benchmarks" / "results").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                commits.add(json.loads(line).get("commit") or "")
            except json.JSONDecodeError:
                pass
    return commits - {""}


def test_every_commit_the_pages_cite_is_one_a_results_row_measured():
    """A figure in prose comes from a row with its commit: every commit README.md, docs/ and the
    recipes' headers name is one some row of benchmarks/results/ records (not typed by hand)."""
    commits = _row_commits()
    pages = [*PAGES, *sorted((REPO / "recipes").glob("*.yaml"))]
    cited = [(page.name, m.group(1)) for page in pages for m in CITED_COMMIT.finditer(page.read_text())
             if re.search("[a-f]", m.group(1)) and re.search("[0-9]", m.group(1))]
    assert len(cited) > 20  # the pages do cite their rows
    assert [c for c in cited if not any(full.startswith(c[1]) for full in commits)] == []


def test_the_benchmarks_page_says_which_tables_are_older_than_their_code():
    """docs/benchmarks.md's freshness table is ``tables.py freshness`` at this checkout: a results
    file whose measured code changed since its newest row is marked stale there, so a changed
    memtrain/ without the page regenerated fails here."""
    import subprocess
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from tables import FRESHNESS_BEGIN, FRESHNESS_END, freshness, staleness

    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode != 0 or any(
            e["newest_commit"] and e["code_changed_since"] is None for e in staleness()):
        pytest.skip("not a git checkout with the rows' commits (a shallow clone): staleness cannot be told")
    text = (REPO / "docs" / "benchmarks.md").read_text()
    shown = text.split(FRESHNESS_BEGIN, 1)[1].split(FRESHNESS_END, 1)[0].strip()
    assert shown == freshness(), "regenerate: python benchmarks/tables.py freshness (into docs/benchmarks.md)"
