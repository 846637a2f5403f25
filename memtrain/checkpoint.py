"""Crash-safe multi-rank checkpoints and exact resume (layout in ../shared/DESIGN.md).

::

    OUTPUT_DIR/checkpoints/
      step_00000100/
        manifest.json        step, plan, world size, engine, config, model shapes, every file's size and sha256
        trainer_state.json   step, cursor epoch, samples/tokens seen, LR scheduler, micro-batch plan (rank 0)
        rank_00000.pt …      each rank's RNG states (Python, NumPy, torch CPU, CUDA)
        …                    the engine's state: model*.safetensors + optimizer.pt (DDP),
                             dcp/ (FSDP2, torch.distributed.checkpoint), zero/ (DeepSpeed)
      latest                 the name of the newest complete checkpoint, replaced atomically

The commit protocol (the one torchtitan and Orbax use, made explicit): every rank writes into
``.tmp-step_XXXXXXXX``; barrier; rank 0 alone checks that every expected file is there, writes
``manifest.json`` with sizes and checksums, fsyncs, renames the directory to ``step_XXXXXXXX``
and replaces ``latest``; then rank 0 broadcasts success or the error, so all ranks agree. The
rank-0-only part calls no collective, so it cannot deadlock. A directory without a manifest is
never loaded, and a killed save leaves only a ``.tmp-`` directory, removed on the next start.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import random
import shutil
import time
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import memtrain
from memtrain.backends.base import Backend
from memtrain.memory import kill

log = logging.getLogger("memtrain")

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or is incomplete, corrupt or incompatible with this run
    (the message names the file or the field)."""


def step_dir_name(step: int) -> str:
    """``step_00000100`` for step 100."""
    return f"step_{step:08d}"


def _step_of(name: str) -> Optional[int]:
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _sha256(path: str, chunk: int = 16 * 2**20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: str) -> None:
    """Flush a file or directory to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files_under(directory: str) -> list[str]:
    """Every file below ``directory`` (relative paths, sorted)."""
    out = []
    for base, _, names in os.walk(directory):
        out += [os.path.relpath(os.path.join(base, n), directory) for n in names]
    return sorted(out)


def complete_checkpoints(root: str) -> list[str]:
    """Checkpoint directories under ``root`` that hold a manifest, oldest step first."""
    if not os.path.isdir(root):
        return []
    found = [(s, os.path.join(root, n)) for n in os.listdir(root) if (s := _step_of(n)) is not None]
    return [p for _, p in sorted(found) if os.path.isfile(os.path.join(p, MANIFEST))]


def verify(path: str) -> dict[str, Any]:
    """Check a checkpoint against its manifest: every listed file present with its size and sha256.

    Returns:
        The manifest.

    Raises:
        CheckpointError: no manifest (an unfinished save), or a missing, truncated or corrupt file
            (named in the message).
    """
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{path}: no {MANIFEST}: the save did not finish (incomplete checkpoint)")
    try:
        with open(manifest_path) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{manifest_path} is unreadable: {exc}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(i, dict) and {"bytes", "sha256"} <= set(i) for i in files.values()):
        raise CheckpointError(f"{manifest_path} is malformed: no file list with sizes and checksums")
    for rel, info in files.items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing (listed in {MANIFEST})")
        size = os.path.getsize(file)
        if size != info["bytes"]:
            raise CheckpointError(f"{file} has {size} bytes, {MANIFEST} says {info['bytes']} (truncated or replaced)")
        if _sha256(file) != info["sha256"]:
            raise CheckpointError(f"{file} is corrupt: its sha256 differs from {MANIFEST}")
    return manifest


def model_shapes(module: nn.Module) -> dict[str, list[int]]:
    """Parameter name → global shape (ZeRO-3's partitioned parameters report ``ds_shape``)."""
    return {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}


def rng_state() -> dict[str, Any]:
    """This process's random states (Python, NumPy, torch CPU, every CUDA device), loadable with
    ``torch.load(weights_only=True)``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tensor_digest(t: torch.Tensor) -> int:
    """A 63-bit hash of a tensor's bytes."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def divergent_tensors(backend: Backend, model: nn.Module) -> list[str]:
    """Names of replicated tensors (see ``Backend.replicated_tensors``) whose bytes differ between
    ranks: a hash per tensor, all-reduced with MAX and with MIN (a collective; every rank calls).

    Returns:
        ``parameter NAME`` / ``buffer NAME`` entries in module order (empty on one rank).
    """
    if backend.world_size == 1:
        return []
    named = backend.replicated_tensors(model)
    if not named:
        return []
    params = {id(p) for _, p in backend.unwrap(model).named_parameters()}
    hi = torch.tensor([_tensor_digest(t) for _, t in named], dtype=torch.int64, device=backend.device)
    lo = hi.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return [("parameter " if id(t) in params else "buffer ") + n
            for (n, t), a, b in zip(named, hi.tolist(), lo.tolist()) if a != b]


class Checkpointer:
    """Saves and restores the full training state with the atomic commit described above.

    Every method is called by every rank at the same point of the loop.

    Args:
        cfg: the run config (``checkpoint``, ``resume``, ``faults``, ``output_dir``).
        backend: the engine (writes its own state; barriers and broadcasts go through the
            default process group).
        vocab_size: the vocabulary size the model was built with (for ``memtrain export``).
        tokenizer: a ``transformers`` tokenizer rank 0 saves into each checkpoint, or None.
    """

    def __init__(self, cfg, backend: Backend, vocab_size: int, tokenizer=None):
        from memtrain.config import to_dict

        self.cfg, self.backend = cfg, backend
        self.vocab_size, self.tokenizer = vocab_size, tokenizer
        self.root = os.path.join(cfg.output_dir, "checkpoints")
        self.config_dict = to_dict(cfg)
        # (tmp dir, step, future or None, manifest extras, start time, seconds blocked so far, error)
        self._pending: Optional[tuple] = None
        self.report = log.info  # where "saved …" lines go (the loop points it at the progress bar)
        self.events: list[dict] = []
        """``checkpoint_saved`` events not yet written to metrics (the loop drains them)."""
        self.preemption = Preemption(backend)
        if cfg.checkpoint.async_save and backend.checkpoint_format != "dcp" and backend.is_main:
            log.warning("memtrain: checkpoint.async_save applies to backend.name fsdp only; %s saves synchronously",
                        backend.name)
        self._clean_stale()

    # -- agreement helpers -------------------------------------------------------------------
    def _broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a collective)."""
        if self.backend.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.backend.device if self.backend.device.type == "cuda" else None)
        return box[0]

    def _on_main(self, fn, *args) -> Any:
        """Run ``fn`` on rank 0 only (it must not call collectives), then let every rank raise its
        error or get its result."""
        result = None
        if self.backend.is_main:
            try:
                result = ("ok", fn(*args))
            except Exception as exc:  # noqa: BLE001 — any failure must reach the other ranks, or they hang
                result = ("error", str(exc) if isinstance(exc, (CheckpointError, OSError))
                          else f"{type(exc).__name__}: {exc}")
        status, value = self._broadcast(result)
        if status == "error":
            raise CheckpointError(value)
        return value

    def _clean_stale(self) -> None:
        """Remove temporary directories a killed save left behind (rank 0), then barrier."""
        def clean():
            if os.path.isdir(self.root):
                for name in os.listdir(self.root):
                    if name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                        log.warning("memtrain: removing %s, left by an unfinished save", os.path.join(self.root, name))
                        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        self._on_main(clean)

    # -- resume ------------------------------------------------------------------------------
    def resume_path(self) -> Optional[str]:
        """The checkpoint to resume from, agreed by all ranks (rank 0 verifies it).

        ``resume: never`` → None; a path → that checkpoint, verified; ``auto`` → ``latest`` when
        it verifies, else the newest complete checkpoint that does (each one refused is named in
        a warning); None when there is none.

        Raises:
            CheckpointError: an explicit path that fails verification, or ``auto`` with
                checkpoints of which none verifies.
        """
        return self._on_main(self._choose)

    def _choose(self) -> Optional[str]:
        mode = self.cfg.resume
        if mode == "never":
            return None
        if mode != "auto":
            verify(mode)
            return mode
        candidates = list(reversed(complete_checkpoints(self.root)))
        latest = os.path.join(self.root, LATEST)
        if os.path.isfile(latest):
            with open(latest) as fh:
                named = os.path.join(self.root, fh.read().strip())
            if named in candidates:
                candidates.remove(named)
                candidates.insert(0, named)
        refused = []
        for path in candidates:
            try:
                verify(path)
                return path
            except CheckpointError as exc:
                refused.append(str(exc))
                log.warning("memtrain: not resuming from %s: %s", path, exc)
        if refused:
            raise CheckpointError("no complete checkpoint verifies: " + "; ".join(refused)
                                  + ". Fix or remove them, or set resume never to start over")
        return None

    def load(self, path: str, model: nn.Module, optimizer, scheduler, controller) -> dict[str, Any]:
        """Restore the full training state from ``path`` (already verified) on every rank.

        Returns:
            The trainer state (``step``, ``tokens_seen``, ``first_loss``, ``initial_val_loss``,
            ``val_loss``, ``eval_micro_batch_size``, …).

        Raises:
            CheckpointError: another engine or model shape, or a world size the engine cannot
                reshard to.
        """
        with open(os.path.join(path, MANIFEST)) as fh:
            manifest = json.load(fh)
        b = self.backend
        if manifest["backend"] != b.name:
            raise CheckpointError(f"{path} was written by backend.name {manifest['backend']}; this run uses {b.name}. "
                                  f"Resume with backend.name {manifest['backend']}, or `memtrain export` its weights")
        shapes = model_shapes(b.unwrap(model))
        if manifest["model_shapes"] != shapes:
            diff = next((k for k in sorted(set(shapes) | set(manifest["model_shapes"]))
                         if shapes.get(k) != manifest["model_shapes"].get(k)), None)
            raise CheckpointError(f"{path}: the model differs from the checkpoint's at parameter {diff}: "
                                  f"checkpoint {manifest['model_shapes'].get(diff)}, this run {shapes.get(diff)}")
        saved_ws = manifest["world_size"]
        b.load_state(model, optimizer, path, saved_ws)
        with open(os.path.join(path, TRAINER_STATE)) as fh:
            state = json.load(fh)
        scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr  # the engine's optimizer state may carry another group lr
        controller.load_state_dict(state["plan"])
        b.set_plan(controller.plan)
        own = b.rank if b.rank < saved_ws else 0
        if saved_ws != b.world_size:
            log.warning("memtrain: resuming a %d-rank checkpoint on %d ranks: data order and plan carry over; "
                        "rank %d takes rank %d's random state", saved_ws, b.world_size, b.rank, own)
        set_rng_state(torch.load(os.path.join(path, _rank_file(own)), weights_only=True))
        return state

    # -- save --------------------------------------------------------------------------------
    def after_step(self, step: int, last: bool, model: nn.Module, optimizer, scheduler, controller,
                   state: dict[str, Any]) -> Optional[str]:
        """End-of-step checkpoint work, with one small all-reduce that makes every rank agree on
        (a) whether a stop signal arrived anywhere and (b) whether a pending asynchronous save
        has finished writing everywhere (then it is committed now, not at the next save).

        Saves when ``checkpoint.every_steps`` divides ``step``, at the ``last`` step (when
        periodic saving is on), and on a stop signal.

        Returns:
            The name of the stop signal (the loop then ends), else None.
        """
        b = self.backend
        writing = self._pending is not None and self._pending[2] is not None and not self._pending[2].done()
        flags = torch.tensor([int(self.preemption.signal_name is not None), int(writing)], device=b.device)
        if b.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, still_writing = bool(flags[0]), bool(flags[1])
        if self._pending is not None and not still_writing:
            self.finish()
        every = self.cfg.checkpoint.every_steps
        if stop or (every and (step % every == 0 or last)):
            self.save(step, model, optimizer, scheduler, controller, state)
        if stop or last:
            self.finish()  # nothing left to overlap a background write with
        return (self.preemption.signal_name or "a stop signal on another rank") if stop else None

    def save(self, step: int, model: nn.Module, optimizer, scheduler, controller, state: dict[str, Any]) -> None:
        """Save the full training state after optimizer step ``step`` (all ranks call).

        Args:
            state: trainer counters for ``trainer_state.json`` (JSON-serialisable): ``step``,
                ``epoch``, ``samples_seen``, ``tokens_seen``, losses for the summary, ….

        Raises:
            CheckpointError: a replicated parameter differs between ranks, or the commit failed
                (the previous complete checkpoint and ``latest`` are untouched).
        """
        b = self.backend
        self.finish()  # an earlier asynchronous save is committed first
        divergent = divergent_tensors(b, model)
        if divergent:
            msg = (f"at step {step}: {len(divergent)} replicated tensor(s) differ between ranks, first: {divergent[0]}"
                   + (f" (also {', '.join(divergent[1:4])}{' …' if len(divergent) > 4 else ''})" if len(divergent) > 1 else ""))
            if divergent[0].startswith("parameter"):
                raise CheckpointError(msg + "; the ranks no longer train the same model, refusing to save")
            log.warning("memtrain: %s; rank 0's copy is saved", msg)
        name = step_dir_name(step)
        tmp = os.path.join(self.root, TMP_PREFIX + name)

        def make_tmp():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self._on_main(make_tmp)  # doubles as the barrier before anyone writes
        start = time.perf_counter()
        future, error = None, None
        try:
            future = b.save_state(model, optimizer, tmp, self.cfg.checkpoint.max_shard_size,
                                  self.cfg.checkpoint.async_save)
            if self.cfg.faults.kill_during_save == step:
                kill(f"half-way through saving step {step}")
            if b.rank in (self.cfg.faults.save_error_ranks or []):
                raise OSError(f"faults.save_error_ranks: injected write failure in {tmp}")
            torch.save(rng_state(), os.path.join(tmp, _rank_file(b.rank)))
            if b.is_main:
                trainer_state = {**state, "scheduler": scheduler.state_dict(), "plan": controller.state_dict()}
                with open(os.path.join(tmp, TRAINER_STATE), "w") as fh:
                    json.dump(trainer_state, fh, indent=1)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        except Exception as exc:  # noqa: BLE001 — reported to every rank in finish(), never left hanging
            error = f"rank {b.rank}: {type(exc).__name__}: {exc}"
        extras = {"plan": controller.state_dict(), "model_shapes": model_shapes(b.unwrap(model)),
                  "vocab_size": self.vocab_size, "replicated_mismatch": divergent}
        self._pending = (tmp, step, future, extras, start, time.perf_counter() - start, error)
        if future is None:
            self.finish()

    def close(self) -> None:
        """Commit what is pending and restore the signal handlers (all ranks call)."""
        self.finish()
        self.preemption.close()

    def finish(self) -> None:
        """Commit the pending save (waiting for an asynchronous write first); all ranks call."""
        if self._pending is None:
            return
        tmp, step, future, extras, start, blocked, error = self._pending
        self._pending = None
        wait_start = time.perf_counter()
        if future is not None and error is None:
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001
                error = f"rank {self.backend.rank}: background write failed: {type(exc).__name__}: {exc}"
        errors = [error]
        if self.backend.world_size > 1:  # every rank learns of any rank's failure (and waits for all)
            errors = [None] * self.backend.world_size
            dist.all_gather_object(errors, error)
        errors = [e for e in errors if e]
        if errors:
            raise CheckpointError(f"saving step {step} failed ({'; '.join(errors)}); the last complete checkpoint "
                                  f"and {LATEST} are untouched")
        path, size = self._on_main(self._commit, tmp, step, extras)
        now = time.perf_counter()
        blocked += now - wait_start  # the loop waits in save() and here, not while a background write runs
        self.events.append({"event": "checkpoint_saved", "step": step, "path": path, "bytes": size,
                            "save_s": now - start, "blocked_s": blocked, "async": future is not None})
        self.report(f"memtrain: saved {path} ({size / 2**20:.1f} MiB) in {now - start:.2f} s "
                    f"(training blocked {blocked:.2f} s)")

    def _commit(self, tmp: str, step: int, extras: dict) -> str:
        """Rank 0 only, no collectives: check, manifest, fsync, rename, ``latest``, retention."""
        b = self.backend
        expected = b.expected_files() + [_rank_file(r) for r in range(b.world_size)] + [TRAINER_STATE]
        missing = [pattern for pattern in expected if not glob.glob(os.path.join(tmp, pattern))]
        if missing:
            raise CheckpointError(f"save of step {step} is incomplete: nothing matches {missing} in {tmp}")
        files = {}
        for rel in _files_under(tmp):
            full = os.path.join(tmp, rel)
            _fsync(full)
            files[rel] = {"bytes": os.path.getsize(full), "sha256": _sha256(full)}
        manifest = {
            "format": 1, "memtrain_version": memtrain.__version__, "torch_version": torch.__version__,
            "step": step, "backend": b.name, "checkpoint_format": b.checkpoint_format, "world_size": b.world_size,
            "zero_stage": getattr(b, "zero_stage", None), "created_unix_s": time.time(),
            **extras, "config": self.config_dict, "files": files,
        }
        with open(os.path.join(tmp, MANIFEST), "w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        for base, _, _ in os.walk(tmp):
            _fsync(base)
        final = os.path.join(self.root, step_dir_name(step))
        if os.path.exists(final):  # a step saved again (resumed from an older checkpoint): swap it out
            trash = os.path.join(self.root, TRASH_PREFIX + step_dir_name(step))
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        latest_tmp = os.path.join(self.root, TMP_PREFIX + LATEST)
        with open(latest_tmp, "w") as fh:
            fh.write(step_dir_name(step) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(latest_tmp, os.path.join(self.root, LATEST))
        _fsync(self.root)
        self._retain(final)
        return final, sum(f["bytes"] for f in files.values())

    def _retain(self, newest: str) -> None:
        """Delete complete checkpoints older than the newest ``keep_last`` (never ``newest``, and
        never one of a later step, which belongs to a timeline this run did not overwrite yet)."""
        step = _step_of(os.path.basename(newest))
        older = [p for p in complete_checkpoints(self.root) if _step_of(os.path.basename(p)) < step]
        for path in older[:max(0, len(older) - (self.cfg.checkpoint.keep_last - 1))]:
            shutil.rmtree(path, ignore_errors=True)


class Preemption:
    """SIGTERM / SIGUSR1 (how SLURM and Kubernetes stop jobs) ask the run to finish its current
    optimizer step, save a checkpoint and exit 0.

    The handler only sets a flag; :meth:`Checkpointer.after_step` all-reduces it once per step
    (MAX), so every rank stops after the same step even when the signal reached only some. Previous
    handlers are restored by :meth:`close`. Handlers can be installed from the main thread only;
    elsewhere this is inert.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, backend: Backend):
        import signal
        import threading

        self.backend = backend
        self.signal_name: Optional[str] = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        import signal

        self.signal_name = signal.Signals(signum).name

    def close(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
