"""What memtrain may write where, so that it never deletes or mixes the user's files.

* **The run folder's lock** (:class:`RunLock`): global rank 0 holds an advisory ``flock`` on
  ``output_dir/.memtrain.lock`` from right after validation until it exits, so a second run
  started in the same ``output_dir`` is refused (exit 2, naming the holder) instead of writing
  into the first one's checkpoints and metrics. The kernel drops the lock when its holder dies
  (a crash, ``kill -9``, a node reboot), so a lock left by a dead run is taken over, and the log
  names the run that left it. Other ranks and other nodes of the same run do not lock.
* **The run folder's files** (:func:`memtrain.checkpoint.layout.check_run_folder`): a run writes its outputs into a folder
  that is new, empty, a memtrain run's, or holds none of the names it writes.
* **Export folders** (:func:`check_export_target`, :func:`replace_export`): an export writes a
  folder of its own, and replaces only a folder that is itself an earlier export (it holds
  :data:`EXPORT_MARKER` and nothing that marker does not list), never one holding other files, the
  run's folder or the checkpoint's; a link to a folder is followed, never replaced.
* **Whole files** (:func:`write_atomic`): every JSON file a run writes beside its checkpoints is
  written whole or not at all.

No torch here: validation and ``memtrain export`` use it before anything heavy is imported.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Optional

from memtrain.config import ConfigError

log = logging.getLogger("memtrain")

LOCK_FILE = ".memtrain.lock"
"""The run folder's lock file (kept after the run: its content names the last holder)."""
ESCAPED_OOM_PREFIX = "oom_escaped"
"""``output_dir/oom_escaped.rankR.json``: an out-of-memory error that escaped the agreement
(:func:`memtrain.oom.record_escaped_oom`)."""
EXPORT_MARKER = "memtrain_export.json"
"""Written into every export folder: the files the export wrote (a later export may replace exactly those)."""


def _describe_holder(text: str) -> str:
    """``PID 1234 on host h (started 2026-11-25 14:03:11 UTC)`` from a lock file's JSON, else the raw text."""
    try:
        info = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info["started_unix_s"]))
        return f"PID {info['pid']} on host {info['host']} (started {started}, command: {info.get('command', '?')})"
    except (ValueError, KeyError, TypeError):
        return repr(text.strip()[:200]) if text.strip() else "an unknown process"


class RunLock:
    """The advisory lock a run holds on its ``output_dir`` (global rank 0 only).

    Args:
        output_dir: the run folder (created when missing: the lock is the run's first write).

    Raises (from :meth:`acquire`):
        ConfigError: another live process holds the folder (field ``output_dir``; the message
            names its PID, host, start time and command), or the folder cannot be written.
    """

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_FILE)
        self._fd: Optional[int] = None
        self._created = False

    def acquire(self) -> "RunLock":
        """Take the lock (non-blocking); a lock file left by a dead holder is taken over, with a
        warning naming it. Returns ``self``."""
        self._created = not os.path.isdir(self.output_dir)
        for _ in range(10):  # a holder that removed the file as we opened it: open the new one
            fd = self._open_locked()
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        else:
            raise ConfigError("output_dir", f"'{self.output_dir}': its lock file keeps being replaced by another "
                              "process; is another run starting there?")
        previous = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        if previous.strip():
            log.warning("memtrain: taking over the lock on %s left by a run that is no longer running: %s",
                        self.output_dir, _describe_holder(previous))
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_unix_s": time.time(),
                             "command": " ".join(sys.argv)[:500]})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        self._fd = fd
        return self

    def _open_locked(self) -> int:
        """The lock file, opened and flocked.

        Raises:
            ConfigError: held by a live process, or not writable.
        """
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError("output_dir", f"'{self.output_dir}' cannot be locked for this run: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            os.close(fd)
            raise ConfigError("output_dir", f"'{self.output_dir}' is in use by another memtrain run: {holder}. Two "
                              "runs in one folder would mix their checkpoints and metrics; wait for it to finish, "
                              "stop it, or give this run another output_dir") from None
        return fd

    def release(self) -> None:
        """Drop the lock; the file is emptied (a clean exit leaves no holder to take over), and
        removed with the folder when this run created the folder and wrote nothing else there."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            if self._created and os.listdir(self.output_dir) == [LOCK_FILE]:
                os.unlink(self.path)  # still holding the lock: a waiting opener sees the inode change
                os.rmdir(self.output_dir)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all: into ``path.tmp``, fsynced, renamed
    over ``path``, the folder fsynced. A kill at any point leaves the old file or the new one; a
    failed write (a full disk) removes the temporary file and raises. The file gets the user's
    umask, as any file ``open`` creates."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def check_max_shard_size(size: str, field: str = "checkpoint.max_shard_size") -> None:
    """``size`` parsed as a save parses it (``5GB``, ``500MB``, ``2GiB``), before anything is written.

    Raises:
        ConfigError: ``field``: not a size, or not above zero (huggingface_hub parses ``-5GB`` as a
            negative size and writes every tensor to a shard of its own).
    """
    try:
        from huggingface_hub.serialization._base import parse_size_to_int
    except ImportError:  # a huggingface_hub without it: the first save checks
        return
    try:
        parsed = parse_size_to_int(size)
    except (ValueError, TypeError):
        raise ConfigError(field, f"{size!r} is not a size; give bytes with a unit, e.g. 5GB, 500MB or 2GiB") from None
    if parsed <= 0:
        raise ConfigError(field, f"{size!r} is not above zero; give bytes with a unit, e.g. 5GB, 500MB or 2GiB")


def _real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def _inside(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or below it (both resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def export_marker(folder: str) -> Optional[dict]:
    """The :data:`EXPORT_MARKER` of ``folder`` (``files``, ``exported_unix_s``, and what the export
    came from: ``step``, ``checkpoint``), or None when it has none or it cannot be read."""
    try:
        with open(os.path.join(folder, EXPORT_MARKER), encoding="utf-8") as fh:
            marker = json.load(fh)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("files"), list) else None


def is_previous_export(folder: str) -> bool:
    """``folder`` holds a memtrain export and nothing else: its :data:`EXPORT_MARKER` lists every
    file in it. A folder without the marker is never taken for one, whatever its files look like
    (a transformers model of the user's holds the same names)."""
    marker = export_marker(folder)
    return marker is not None and set(os.listdir(folder)) - {EXPORT_MARKER} <= set(marker["files"])


def check_export_target(out: str, protected: list[str], field: str = "out",
                        hint: str = "nothing was written. Give a new or empty folder") -> None:
    """Refuse an export target that would remove or mix with anything an export did not write.

    Args:
        out: the target folder.
        protected: folders the target must not be, nor lie inside (the run folder and the
            checkpoint being exported).
        field, hint: the setting an error names, and what its message ends with.

    Raises:
        ConfigError: ``field``: the target is (inside) a protected folder, contains one,
            is a file, or is a non-empty folder that is not an earlier export (the message names
            the files it holds).
    """
    target = _real(out)
    folders = [_real(f) for f in protected]
    for relation, hit in (("the", lambda f: target == f), ("inside", lambda f: _inside(target, f)),
                          ("above", lambda f: _inside(f, target))):
        for folder in folders:
            if hit(folder):
                raise ConfigError(field, f"'{out}' is {relation} folder '{folder}' of the run or checkpoint being "
                                  "exported; exporting there could overwrite its files. Give a folder outside the run, "
                                  "e.g. exports/<run name>")
    if os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(field, f"'{out}' exists and is not a folder")
    if os.path.isdir(target) and os.listdir(target) and not is_previous_export(target):
        held = sorted(os.listdir(target))
        raise ConfigError(field, f"'{out}' is not empty and is not an earlier memtrain export (it holds "
                          f"{', '.join(held[:5])}{' …' if len(held) > 5 else ''}; an export holds "
                          f"{EXPORT_MARKER}); {hint}")
    parent = nearest_existing(os.path.dirname(target))
    if not os.access(parent or ".", os.W_OK):
        raise ConfigError(field, f"'{out}' cannot be written: the export is written beside it and renamed into place, "
                          f"and '{parent}' is not writable; {hint}")


def replace_export(tmp: str, out: str, about: Optional[dict] = None) -> str:
    """Move the finished export ``tmp`` (a folder beside ``out``, :func:`new_export_folder`) to
    ``out``: written :data:`EXPORT_MARKER` (the files, and ``about``: what the export came from),
    then, when ``out`` is an earlier export, that export is renamed aside and removed only after
    the new one is in place (a crash between the two renames leaves the earlier export whole in a
    ``.replaced-`` folder beside it). A symbolic link is followed: the export lands where it
    points, and the link stays. Every file and folder gets the permissions the user's umask gives.

    Returns:
        The folder written (``out`` with its links resolved).

    Raises:
        ConfigError: ``out`` became something else than an earlier export meanwhile.
    """
    mask, files = _umask(), []
    for base, folders, names in os.walk(tmp):  # a library may write 0600 (a temporary file renamed)
        for name in folders:
            os.chmod(os.path.join(base, name), 0o777 & ~mask)
        for name in names:
            os.chmod(os.path.join(base, name), 0o666 & ~mask)
            files.append(os.path.relpath(os.path.join(base, name), tmp))
    files.sort()
    write_atomic(os.path.join(tmp, EXPORT_MARKER),
                 json.dumps({"files": files, "exported_unix_s": time.time(), **(about or {})}, indent=1))
    out = _real(out)
    if os.path.isdir(out) and os.listdir(out):
        if not is_previous_export(out):
            raise ConfigError("out", f"'{out}' is not empty and is not an earlier memtrain export; nothing was replaced")
        aside = tempfile.mkdtemp(prefix=f".replaced-{os.path.basename(out)}-", dir=os.path.dirname(out))
        os.rmdir(aside)
        os.replace(out, aside)
        os.replace(tmp, out)
        shutil.rmtree(aside, ignore_errors=True)
        return out
    if os.path.isdir(out):
        os.rmdir(out)  # empty: nothing of anyone's is lost
    os.replace(tmp, out)
    return out


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _export_tmp_prefix(real_out: str, pid: Optional[int] = None) -> str:
    """``.tmp-<out's name>-<pid>-`` (``pid`` None: every process's ``.tmp-<name>-``)."""
    return f".tmp-{os.path.basename(real_out)}-" + ("" if pid is None else f"{pid}-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def new_export_folder(out: str) -> str:
    """A new, empty temporary folder beside ``out`` (its links resolved) for an export to be
    written into (its own name, with this process's id: never a folder someone else owns), with the
    permissions the user's umask gives a new folder (not ``mkdtemp``'s 0700). The folders an
    earlier export to ``out`` left when it was killed (its process gone) are removed first, each
    named in a warning."""
    real = _real(out)
    parent = os.path.dirname(real)
    os.makedirs(parent, exist_ok=True)
    prefix = _export_tmp_prefix(real)
    for name in sorted(os.listdir(parent)):
        pid = name[len(prefix):].split("-", 1)[0]
        path = os.path.join(parent, name)
        if name.startswith(prefix) and pid.isdigit() and not _pid_alive(int(pid)) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            log.warning("memtrain: removed %s, the temporary folder of an export to %s that was stopped", path, real)
    tmp = tempfile.mkdtemp(prefix=_export_tmp_prefix(real, os.getpid()), dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def nearest_existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists ("." for a relative path none of whose
    ancestors exist; "" stays ""): where a folder about to be created would live."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path.rstrip(os.sep)) or "."
    return path


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that found no room: ``ENOSPC``/``EDQUOT``, or the words of
    libraries that report a short write without an errno (torch's zip writer: "unexpected pos";
    NumPy: "N requested and M written"; Rust libraries: "No space left on device")."""
    import errno

    text = str(exc)
    return ((isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or "unexpected pos" in text
            or "No space left" in text or (" requested and " in text and text.rstrip().endswith(" written")))


def write_error(exc: BaseException, directory: str, setting: str = "output_dir") -> str:
    """A failed write (a checkpoint, an export, the data cache), described: a full disk
    (:func:`is_disk_full`) is named as such, with the path, the free bytes of its file system and
    ``setting``, the one to point elsewhere; any other error as its type and message."""
    text = f"{type(exc).__name__}: {exc}"
    if not is_disk_full(exc):
        return text
    free = shutil.disk_usage(nearest_existing(directory) or ".").free
    return (f"the disk is full (or over quota) writing {directory}: {free:,} bytes free on that file system; free "
            f"space or point {setting} elsewhere ({text})")
