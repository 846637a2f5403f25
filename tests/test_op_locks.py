"""Stale locks of DeepSpeed's op builds (memtrain/backends/op_locks.py): a build stopped half-way
leaves ``<build folder>/lock``, on which torch's extension loader makes every later process wait
forever; memtrain removes it when no process builds there, and leaves a live build's lock alone."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO
from memtrain.backends.op_locks import LOCK_GRACE_S, remove_stale_lock, stale_lock


def _lock(folder, age_s: float) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "lock")
    open(path, "w").close()
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


def test_an_old_lock_with_no_builder_is_stale_and_a_live_or_new_one_is_not(tmp_path):
    folder = str(tmp_path / "py311_cpu" / "deepspeed_shm_comm")
    assert stale_lock(folder) is None  # no lock
    lock = _lock(folder, LOCK_GRACE_S + 60)
    assert stale_lock(folder) == lock
    # a compiler at work in the folder (ninja runs there): the build is alive, whatever the lock's age
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=folder)
    try:
        time.sleep(0.5)
        assert stale_lock(folder) is None
    finally:
        worker.kill()
        worker.wait()
    _lock(folder, 5)  # a build starting up: not yet in its folder
    assert stale_lock(folder) is None
    _lock(folder, LOCK_GRACE_S + 60)
    open(os.path.join(folder, "op.so"), "w").close()  # a build loading what it just wrote
    assert stale_lock(folder) is None


def test_a_lock_its_loader_holds_open_is_not_stale_whatever_its_age(tmp_path):
    """torch's ``FileBaton`` keeps the lock's descriptor open from taking it to releasing it: a
    loader that holds it (working elsewhere, the lock and its folder old, as when the files' clock
    is off or a build is slow) keeps it; once the loader is gone the lock is stale."""
    folder = str(tmp_path / "deepspeed_shm_comm")
    lock = _lock(folder, LOCK_GRACE_S + 60)
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "print('held', flush=True); time.sleep(60)", lock], cwd=tmp_path,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert stale_lock(folder) is None
        assert remove_stale_lock(folder) is None and os.path.exists(lock)
    finally:
        holder.kill()
        holder.wait()
    assert remove_stale_lock(folder) == lock and not os.path.exists(lock)


@pytest.mark.timeout(60)
def test_two_cleaners_never_remove_the_lock_a_third_process_took_between_them(tmp_path):
    """Two runs starting together find one stale lock; the first removes it, a loader takes a new
    one, and the second cleaner, which judged the old lock stale, must not remove the new one:
    the second waits on the folder's ``flock`` while the first judges and removes, and judges again."""
    folder = str(tmp_path / "deepspeed_shm_comm")
    stale = _lock(folder, LOCK_GRACE_S + 60)
    first = os.open(folder, os.O_RDONLY)
    fcntl.flock(first, fcntl.LOCK_EX)  # the first cleaner at work
    removed = []
    second = threading.Thread(target=lambda: removed.append(remove_stale_lock(folder)))
    second.start()
    time.sleep(0.5)
    assert second.is_alive() and os.path.exists(stale)  # the second waits, and has removed nothing
    os.remove(stale)  # the first removes the stale lock; a loader takes a new one
    taken = _lock(folder, 0)
    os.close(first)
    second.join(10)
    assert removed == [None] and os.path.exists(taken)


@pytest.mark.timeout(240)
def test_deepspeed_loads_its_op_after_a_stopped_build_s_lock_is_cleared(tmp_path):
    """The real loader: the built ``shm_comm`` op is copied into an extensions folder of the test's
    own with a stale lock beside it; after :func:`clear_stale_locks` DeepSpeed loads the op (with
    the lock left there it waits until the time limit)."""
    pytest.importorskip("deepspeed")
    from memtrain.memory.machine import deepspeed_op_built, deepspeed_op_folders

    folders = deepspeed_op_folders("ShareMemCommBuilder")
    if not folders or not deepspeed_op_built("ShareMemCommBuilder"):
        pytest.skip("DeepSpeed's shm_comm op is not built on this machine")
    copy = tmp_path / "ext" / os.path.basename(folders[0])  # $TORCH_EXTENSIONS_DIR/<op>, as torch lays it out
    shutil.copytree(folders[0], copy, ignore=shutil.ignore_patterns("lock"))
    past = time.time() - LOCK_GRACE_S - 60
    for name in os.listdir(copy):  # the stopped build's files, as old as its lock
        os.utime(copy / name, (past, past))
    lock = _lock(str(copy), LOCK_GRACE_S + 60)
    script = ("import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
              "from memtrain.backends.op_locks import clear_stale_locks\n"
              "print('removed', clear_stale_locks(['ShareMemCommBuilder']))\n"
              "from deepspeed.accelerator import get_accelerator\n"
              "get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False)\n"
              "print('loaded')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=200, cwd=REPO,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"removed ['{lock}']" in done.stdout and "loaded" in done.stdout
    assert "left by a DeepSpeed op build that was stopped" in done.stderr
    assert not os.path.exists(lock)
