"""The fork server stands in for torchrun: the same worker environment, the same exit status and
failure summary, and the others stopped when one rank fails — checked against torchrun itself."""

import json
import time

from conftest import TORCHRUN, child_exit_codes, launch, run_cli

SCRIPT = r"""
import json, os, sys, time
rank = int(os.environ["RANK"])
print("ENV " + json.dumps(dict(os.environ)), flush=True)
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(3)
if sys.argv[1] == "fail":
    time.sleep(60)  # stopped by the launcher when rank 1 fails
"""
PER_LAUNCH = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")  # a port, a name, a path per launch


def _envs(proc) -> list[dict]:
    envs = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ENV ")]
    return sorted(({k: v for k, v in env.items() if k not in PER_LAUNCH} for env in envs), key=lambda env: env["RANK"])


def test_ranks_see_what_torchrun_gives_them_and_a_failure_ends_like_under_torchrun(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    forked, real = launch(["ok"], script=str(script)), launch(["ok"], script=str(script), launcher=TORCHRUN)
    assert forked.returncode == real.returncode == 0
    assert _envs(forked) == _envs(real) and len(_envs(real)) == 2
    start = time.perf_counter()
    forked = launch(["fail"], script=str(script), check=False)
    assert time.perf_counter() - start < 30  # rank 0 was stopped, not waited for
    real = launch(["fail"], script=str(script), launcher=TORCHRUN, check=False)
    assert forked.returncode == real.returncode == 1
    assert child_exit_codes(forked) == child_exit_codes(real) == {3, -15}  # rank 0 stopped by SIGTERM


def test_one_process_run_has_no_launcher_variables(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text("import os, sys\nprint('RANK' in os.environ)\nsys.exit(7)\n")
    proc = run_cli([], script=script)
    assert proc.returncode == 7 and proc.stdout.strip() == "False"
