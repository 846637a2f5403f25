"""The host allocator's thresholds (memtrain/host_allocator.py): set unless the user chose, and
they take effect — freed activations are not page-faulted in again every step."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from memtrain.host_allocator import glibc_version, reason_to_leave

# a step-like pattern in a fresh process, through the C allocator torch's CPU tensors use: 64
# activations of 100 KiB (6.4 MB; or as many KiB as the second argument says) are allocated,
# written and freed, 12 times (no torch import, whose
# own allocations would move glibc's dynamic thresholds before the test begins)
STEP_SCRIPT = r"""
import ctypes, json, resource, sys
from memtrain.host_allocator import fix_thresholds
fixed = fix_thresholds(sys.argv[1] != "off", environ={}, return_freed=sys.argv[1] == "return")
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = int(sys.argv[2]) * 1024 if len(sys.argv) > 2 else 100 * 1024
def data_bytes():  # what RLIMIT_DATA is compared with
    return int(open("/proc/self/status").read().split("VmData:")[1].split()[0]) * 1024
faults, kept = [], []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    activations = [libc.malloc(size) for _ in range(64)]
    for a in activations:
        ctypes.memset(a, 1, size)
    held = data_bytes()
    for a in activations:
        libc.free(a)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    kept.append(data_bytes() - (held - 64 * size))  # what the process keeps of what it freed
print(json.dumps({"fixed": fixed, "faults": faults[2:], "kept": kept[2:], "page_bytes": resource.getpagesize()}))
"""


def faults_per_step(setting: str, kib: int = 100) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD",
                                                                                         "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", STEP_SCRIPT, setting, str(kib)], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(glibc_version() is None, reason="glibc's mallopt")
def test_fixed_thresholds_keep_freed_activations_from_faulting_in_again():
    default, fixed = faults_per_step("off"), faults_per_step("on")
    assert default["fixed"] is None and fixed["fixed"] == {"mmap_threshold_bytes": 32 * 2**20,
                                                           "trim_threshold_bytes": 64 * 2**20}
    # glibc's own thresholds return the 6.4 MB to the OS after every step: every page (1,600 of
    # 4 KiB) faults in again; with the thresholds fixed almost none does
    pages = 64 * 100 * 1024 // default["page_bytes"]
    assert min(default["faults"]) > 0.6 * pages, default
    assert max(fixed["faults"]) < 0.06 * pages, fixed
    assert min(fixed["kept"]) > 0.9 * 64 * 100 * 1024, fixed  # the price: the process keeps them


@pytest.mark.skipif(glibc_version() is None, reason="glibc's mallopt")
def test_under_a_hard_limit_freed_activations_go_back_to_the_os():
    """``return_freed`` (a CPU run under a hard host limit): the thresholds are fixed at glibc's
    starting 128 KiB, and the process's data segment — what ``RLIMIT_DATA`` counts — gives back
    what the step freed, where the speed setting keeps all of it."""
    returned = faults_per_step("return")
    assert returned["fixed"] == {"mmap_threshold_bytes": 128 * 2**10, "trim_threshold_bytes": 128 * 2**10}
    assert max(returned["kept"]) < 0.1 * 64 * 100 * 1024, returned


@pytest.mark.parametrize("environ, platform, reason", [
    ({}, "linux", None),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "linux", "set by the environment (MALLOC_TRIM_THRESHOLD_)"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"}, "linux", "set by the environment (GLIBC_TUNABLES)"),
    ({"GLIBC_TUNABLES": "glibc.rtld.nns=4"}, "linux", None),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "linux", "another allocator is preloaded (jemalloc)"),
    ({"MALLOC_MMAP_MAX_": "0"}, "linux", "set by the environment (MALLOC_MMAP_MAX_)"),
    ({}, "darwin", "not glibc (darwin)"),
])
def test_the_users_own_allocator_choice_is_left_alone(environ, platform, reason):
    assert reason_to_leave(environ, platform, libc="glibc 2.36") == reason


def test_another_c_library_is_left_alone_and_nothing_raises(monkeypatch):
    assert reason_to_leave({}, "linux", libc=None) == "not glibc (linux)"  # e.g. musl

    class NoMallopt:  # a C library without mallopt
        def __init__(self, name):
            pass

    import ctypes

    from memtrain import host_allocator

    monkeypatch.setattr(ctypes, "CDLL", NoMallopt)
    monkeypatch.setattr(host_allocator, "glibc_version", lambda: "glibc 2.36")
    assert host_allocator.fix_thresholds(True, environ={}) is None


@pytest.mark.parametrize("setting,owns_process,cpu_run,expected", [
    (None, False, True, (True, True)), (None, True, True, (True, True)),  # a CPU run returns freed memory
    (None, True, False, (True, False)), (None, False, False, (False, False)),  # a GPU run: only memtrain's process
    (True, False, True, (True, False)), (True, False, False, (True, False)),  # the speed setting, asked for
    (False, True, True, (False, False))])
def test_the_policy_returns_freed_memory_on_a_cpu_run_and_tunes_a_gpu_run_only_in_its_own_process(
        setting, owns_process, cpu_run, expected):
    from memtrain.host_allocator import policy

    assert policy(setting, owns_process, cpu_run) == expected


@pytest.mark.parametrize("how,setting,expected", [
    ("python", None, (True, True)), ("python", "true", (True, False)),
    ("command_line", None, (True, True)), ("command_line", "false", (False, False))])
def test_a_cpu_run_returns_freed_memory_in_any_process_unless_told(tmp_path, monkeypatch, how, setting, expected):
    """``memory.host_allocator_thresholds`` null on a CPU run: both the ``memtrain`` command and
    ``memtrain.Trainer`` in a user's process fix glibc's thresholds at 128 KiB (``return_freed``),
    so the resident set follows the plan; an explicit setting wins. Stopped right after the
    decision (nothing trained)."""
    import memtrain
    from memtrain import host_allocator
    from memtrain.train import main

    asked = []

    def record(enabled=True, environ=None, return_freed=False):
        asked.append((enabled, return_freed))
        raise KeyboardInterrupt  # the decision is made: stop the run here

    monkeypatch.setattr(host_allocator, "fix_thresholds", record)
    args = ["--output_dir", str(tmp_path / "run"), *(["--memory.host_allocator_thresholds", setting] if setting else [])]
    with pytest.raises(KeyboardInterrupt):
        if how == "python":
            memtrain.Trainer(model=lambda: torch.nn.Linear(2, 1),
                             train_dataset=[{"x": torch.zeros(2)}] * 8, args=args).fit()
        else:
            main(["--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), *args])
    assert asked == [expected]
