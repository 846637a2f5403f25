"""The fork server stands in for torchrun: the same worker environment, the same exit status and
failure summary, and the others stopped when one rank fails — checked against torchrun itself."""

import json
import time

from conftest import TORCHRUN, child_exit_codes, launch, run_cli

SCRIPT = r"""
import json, os, sys, time
rank = int(os.environ["RANK"])
with open(os.path.join(sys.argv[2], f"env{rank}.json"), "w") as fh:  # a file: lines of two ranks can mix on a pipe
    json.dump(dict(os.environ), fh)
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(3)
if sys.argv[1] == "fail":
    time.sleep(60)  # stopped by the launcher when rank 1 fails
"""
PER_LAUNCH = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")  # a port, a name, a path per launch


def _envs(folder) -> list[dict]:
    envs = [json.loads(path.read_text()) for path in sorted(folder.glob("env*.json"))]
    return [{k: v for k, v in env.items() if k not in PER_LAUNCH} for env in envs]


def test_ranks_see_what_torchrun_gives_them_and_a_failure_ends_like_under_torchrun(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    (tmp_path / "forked").mkdir()
    (tmp_path / "real").mkdir()
    forked = launch(["ok", str(tmp_path / "forked")], script=str(script))
    real = launch(["ok", str(tmp_path / "real")], script=str(script), launcher=TORCHRUN)
    assert forked.returncode == real.returncode == 0
    assert _envs(tmp_path / "forked") == _envs(tmp_path / "real") and len(_envs(tmp_path / "real")) == 2
    start = time.perf_counter()
    forked = launch(["fail", str(tmp_path)], script=str(script), check=False)
    assert time.perf_counter() - start < 30  # rank 0 was stopped, not waited for
    real = launch(["fail", str(tmp_path)], script=str(script), launcher=TORCHRUN, check=False)
    assert forked.returncode == real.returncode == 1
    assert child_exit_codes(forked) == child_exit_codes(real) == {3, -15}  # rank 0 stopped by SIGTERM


def test_one_process_run_has_no_launcher_variables(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text("import os, sys\nprint('RANK' in os.environ)\nsys.exit(7)\n")
    proc = run_cli([], script=script)
    assert proc.returncode == 7 and proc.stdout.strip() == "False"
