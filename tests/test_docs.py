"""The front door: README.md stays short, its two set-up commands are the ones CI and a newcomer
run, and every link in README.md and docs/ points at a file and heading that exist."""

import re
from pathlib import Path

import pytest

from conftest import REPO

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
def test_the_python_page_runs_as_written(tmp_path):
    """docs/python.md's program and commands, as written but for ``runs/`` (a temporary folder):
    each exits 0; the program's and the examples' validation losses fall; the exported model
    the last command fine-tunes is the third command's."""
    import os
    import subprocess
    import sys

    page = (REPO / "docs" / "python.md").read_text()
    program, = fenced_blocks(page, "python")
    commands, = fenced_blocks(page, "bash")
    runs = f"{tmp_path}/runs/"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                                           os.environ["PATH"]])}
    script = tmp_path / "quickstart.py"
    script.write_text(program.replace("runs/", runs))
    outputs = [subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=REPO,
                              env=env)]
    for line in commands.strip().splitlines():
        outputs.append(subprocess.run(line.replace("runs/", runs), shell=True, capture_output=True, text=True,
                                      timeout=300, cwd=REPO, env=env))
        assert outputs[-1].returncode == 0, (line, outputs[-1].stderr[-4000:])
    assert outputs[0].returncode == 0, outputs[0].stderr[-4000:]
    for out in (outputs[0], outputs[1], outputs[2], outputs[4]):  # the program and the scripts print it
        first, last = map(float, re.search(r"validation loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
        assert last < first, out.stdout[-2000:]
    assert (tmp_path / "runs" / "finetune" / "model" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "finetune" / "model" / "tokenizer.json").is_file()  # the tokenizer handed over
