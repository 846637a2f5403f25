"""In-process tests of the checkpoint directory layout (memtrain/checkpoint/layout.py): commit,
verify, retain, resume choice and cleanup on fake checkpoints made of small files."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from memtrain.checkpoint import layout
from memtrain.checkpoint.layout import (LATEST, MANIFEST, TMP_PREFIX, TRASH_PREFIX, choose_resume, clean_stale,
                                        commit, complete_checkpoints, retain, step_dir_name, verify)
from memtrain.errors import CheckpointError

EXPECTED = ["model*.safetensors", "rank_*.pt"]


def files_for(step: int) -> dict[str, bytes]:
    """Distinct small contents per step, one of them in a subdirectory."""
    return {"model.safetensors": b"weights-%d" % step * 10, "rank_00000.pt": b"rng-%d" % step,
            "dcp/shard_0.bin": bytes(range(step % 7, 64))}


def write_tmp(root, step: int, files: dict[str, bytes]) -> str:
    tmp = root / (TMP_PREFIX + step_dir_name(step))
    for rel, data in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    return str(tmp)


def save(root, step: int, files: dict[str, bytes] | None = None) -> str:
    """A committed fake checkpoint of ``step``; returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = write_tmp(root, step, files or files_for(step))
    path, _ = commit(tmp, str(root), step, EXPECTED, {"step": step, "world_size": 1})
    return path


def latest(root) -> str:
    return (root / LATEST).read_text().strip()


def flip_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[0] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_step_dir_name_is_zero_padded():
    """step_dir_name pads the step to 8 digits, so names sort by step."""
    assert step_dir_name(100) == "step_" + "100".zfill(8)
    assert sorted(step_dir_name(s) for s in (10, 9, 100)) == [step_dir_name(s) for s in (9, 10, 100)]


def test_commit_writes_manifest_renames_and_points_latest(tmp_path):
    """commit lists every file with size and sha256, keeps the given fields, renames tmp and sets latest."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    files = files_for(7)
    tmp = write_tmp(root, 7, files)
    path, total = commit(tmp, str(root), 7, EXPECTED, {"step": 7, "world_size": 1})

    assert path == str(root / step_dir_name(7))
    assert not os.path.exists(tmp)
    manifest = json.loads((root / step_dir_name(7) / MANIFEST).read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert manifest["files"] == {rel: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                                 for rel, data in files.items()}
    assert total == sum(len(d) for d in files.values())
    assert latest(root) == step_dir_name(7)
    assert verify(path) == manifest


def test_commit_with_missing_expected_file_fails_and_changes_nothing(tmp_path):
    """A pattern matching nothing raises CheckpointError naming it; no step directory, latest unchanged."""
    root = tmp_path / "checkpoints"
    save(root, 1)
    tmp = write_tmp(root, 2, {"rank_00000.pt": b"rng"})
    with pytest.raises(CheckpointError, match=r"model\*\.safetensors"):
        commit(tmp, str(root), 2, EXPECTED, {"step": 2})
    assert not (root / step_dir_name(2)).exists()
    assert latest(root) == step_dir_name(1)
    assert complete_checkpoints(str(root)) == [str(root / step_dir_name(1))]


def test_commit_same_step_twice_replaces_it(tmp_path):
    """Committing a step again swaps in the new contents and leaves no .trash- or .tmp- entry."""
    root = tmp_path / "checkpoints"
    save(root, 3, {"model.safetensors": b"old", "rank_00000.pt": b"old"})
    save(root, 4)
    path = save(root, 3, {"model.safetensors": b"new contents", "rank_00000.pt": b"new"})
    assert (root / step_dir_name(3) / "model.safetensors").read_bytes() == b"new contents"
    verify(path)
    assert latest(root) == step_dir_name(3)
    assert not [n for n in os.listdir(root) if n.startswith((TRASH_PREFIX, TMP_PREFIX))]


def test_complete_checkpoints_only_with_manifest_oldest_first(tmp_path):
    """complete_checkpoints lists step directories holding a manifest, oldest step first."""
    root = tmp_path / "checkpoints"
    for step in (10, 2, 9):
        save(root, step)
    (root / step_dir_name(11)).mkdir()  # no manifest: unfinished
    write_tmp(root, 12, files_for(12))
    assert complete_checkpoints(str(root)) == [str(root / step_dir_name(s)) for s in (2, 9, 10)]
    assert complete_checkpoints(str(tmp_path / "absent")) == []


# -- verify ----------------------------------------------------------------------------------

def test_verify_missing_file(tmp_path):
    """verify names a file listed in the manifest that is gone."""
    path = save(tmp_path, 1)
    os.remove(os.path.join(path, "rank_00000.pt"))
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt is missing"):
        verify(path)


def test_verify_truncated_file(tmp_path):
    """verify names a file whose size differs from the manifest."""
    path = save(tmp_path, 1)
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[:-3])
    with pytest.raises(CheckpointError, match=rf"model\.safetensors has {len(data) - 3} bytes"):
        verify(path)


def test_verify_flipped_byte(tmp_path):
    """verify names a file of the right size whose sha256 differs (corrupt)."""
    path = save(tmp_path, 1)
    flip_byte(os.path.join(path, "dcp", "shard_0.bin"))
    with pytest.raises(CheckpointError, match=r"shard_0\.bin is corrupt"):
        verify(path)


def test_verify_without_manifest(tmp_path):
    """verify refuses a directory without manifest as an unfinished save."""
    path = tmp_path / step_dir_name(5)
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="did not finish"):
        verify(str(path))


# -- retain ----------------------------------------------------------------------------------

def test_retain_keeps_newest_keep_last(tmp_path):
    """retain deletes all but the newest keep_last checkpoints and returns the deleted paths."""
    root = tmp_path / "checkpoints"
    paths = [save(root, s) for s in range(1, 6)]
    deleted = retain(str(root), paths[-1], 2)
    assert deleted == paths[:3]
    assert complete_checkpoints(str(root)) == paths[3:]


def test_retain_never_deletes_newest(tmp_path):
    """retain with keep_last 1 keeps exactly the newest checkpoint."""
    root = tmp_path / "checkpoints"
    paths = [save(root, s) for s in range(1, 4)]
    retain(str(root), paths[-1], 1)
    assert complete_checkpoints(str(root)) == [paths[-1]]


def test_retain_never_deletes_later_steps(tmp_path):
    """retain keeps checkpoints of a later step than newest (another timeline), and does not count them."""
    root = tmp_path / "checkpoints"
    later = save(root, 8)
    p1, p2, p3 = (save(root, s) for s in (1, 2, 3))  # resumed from an older checkpoint
    deleted = retain(str(root), p3, 2)
    assert deleted == [p1]
    assert complete_checkpoints(str(root)) == [p2, p3, later]


# -- choose_resume ---------------------------------------------------------------------------

def test_choose_resume_auto_prefers_latest(tmp_path):
    """auto takes the checkpoint latest names, even when one of a later step exists."""
    root = tmp_path / "checkpoints"
    save(root, 1)
    save(root, 2)
    p1 = save(root, 1)  # saved again: latest now names step 1
    assert choose_resume(str(root), "auto") == p1


def test_choose_resume_auto_falls_back_when_latest_is_corrupt(tmp_path):
    """auto skips a corrupt latest for the newest checkpoint that verifies, and keeps the corrupt one."""
    root = tmp_path / "checkpoints"
    save(root, 1)
    p2 = save(root, 2)
    p3 = save(root, 3)
    flip_byte(os.path.join(p3, "model.safetensors"))
    assert choose_resume(str(root), "auto") == p2
    assert os.path.isdir(p3)


def test_choose_resume_auto_without_checkpoints(tmp_path):
    """auto returns None when there is no checkpoint (missing or empty root, or only unfinished ones)."""
    root = tmp_path / "checkpoints"
    assert choose_resume(str(root), "auto") is None
    root.mkdir()
    (root / step_dir_name(1)).mkdir()
    write_tmp(root, 2, files_for(2))
    assert choose_resume(str(root), "auto") is None


def test_choose_resume_auto_none_verifies(tmp_path):
    """auto raises CheckpointError naming each refused checkpoint when none verifies."""
    root = tmp_path / "checkpoints"
    paths = [save(root, s) for s in (1, 2)]
    for p in paths:
        flip_byte(os.path.join(p, "rank_00000.pt"))
    with pytest.raises(CheckpointError, match="no complete checkpoint verifies") as info:
        choose_resume(str(root), "auto")
    assert all(p in str(info.value) for p in paths)


def test_choose_resume_never(tmp_path):
    """never returns None even when a valid checkpoint exists."""
    root = tmp_path / "checkpoints"
    save(root, 1)
    assert choose_resume(str(root), "never") is None


def test_choose_resume_explicit_path_is_verified(tmp_path):
    """An explicit path is returned when it verifies and raises CheckpointError naming the file when corrupt."""
    root = tmp_path / "checkpoints"
    p1 = save(root, 1)
    p2 = save(root, 2)
    assert choose_resume(str(root), p1) == p1
    flip_byte(os.path.join(p2, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt"):
        choose_resume(str(root), p2)


# -- clean_stale -----------------------------------------------------------------------------

def test_clean_stale_removes_only_tmp_and_trash_directories(tmp_path):
    """clean_stale removes .tmp-/.trash- directories and leaves checkpoints, latest and other entries."""
    root = tmp_path / "checkpoints"
    p1 = save(root, 1)
    write_tmp(root, 2, files_for(2))
    (root / (TRASH_PREFIX + step_dir_name(1))).mkdir()
    (root / (TRASH_PREFIX + step_dir_name(1)) / "model.safetensors").write_bytes(b"x")
    (root / "notes").mkdir()
    (root / "README").write_text("keep")
    clean_stale(str(root))
    assert sorted(os.listdir(root)) == sorted([step_dir_name(1), LATEST, "notes", "README"])
    verify(p1)
    clean_stale(str(tmp_path / "absent"))  # no root: nothing to do


def test_sha256_matches_hashlib(tmp_path):
    """layout.sha256 reads the file in chunks and agrees with hashlib on the whole bytes."""
    file = tmp_path / "f"
    data = bytes(range(256)) * 5
    file.write_bytes(data)
    assert layout.sha256(str(file), chunk=100) == hashlib.sha256(data).hexdigest()


def test_a_path_that_is_not_one_checkpoint_says_what_was_expected(tmp_path):
    """resume PATH / memtrain export PATH at a missing path, a run folder, a checkpoints folder or
    some other folder: each message says what the path is and what is expected."""
    from memtrain.checkpoint.layout import MANIFEST, verify
    from memtrain.errors import CheckpointError

    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / MANIFEST).write_text("{}")
    (tmp_path / "other").mkdir()
    (tmp_path / "run" / "checkpoints" / "step_00000008").mkdir()  # a save that did not finish
    cases = {tmp_path / "missing": "does not exist",
             tmp_path / "run": f"is a run folder, not one checkpoint; give one of its checkpoints (the newest: {step})",
             tmp_path / "run" / "checkpoints": "is a checkpoints folder",
             tmp_path / "other": "is not a memtrain checkpoint",
             tmp_path / "run" / "checkpoints" / "step_00000008": "the save did not finish"}
    for path, phrase in cases.items():
        with pytest.raises(CheckpointError, match=None) as info:
            verify(str(path))
        assert phrase in str(info.value), (path, str(info.value))


def test_resume_refuses_settings_that_move_the_data_position():
    """Another global batch, seed or seq_len, or other data: refused by name; another world size,
    plan or max_steps: accepted."""
    from memtrain.checkpoint.compat import ResumeRules
    from memtrain.levers import resume_rules

    check_resumable = ResumeRules.with_levers(resume_rules()).check  # as the loop checks
    from memtrain.config import ConfigError, parse_args, to_dict

    base = ["--config", "recipes/code_lm_tiny.yaml"]
    saved = {"config": to_dict(parse_args(base)), "data_identity": "corpus-abc"}
    check_resumable("ck", saved, to_dict(parse_args(base + ["--training.max_steps", "9", "--training.micro_batch_size",
                                                            "4", "--backend.name", "fsdp"])), "corpus-abc")
    for extra, field in [(["--training.global_batch_size", "64"], "training.global_batch_size"),
                         (["--training.seed", "7"], "training.seed"), (["--data.seq_len", "64"], "data.seq_len")]:
        with pytest.raises(ConfigError) as info:
            check_resumable("ck", saved, to_dict(parse_args(base + extra)), "corpus-abc")
        assert info.value.field == field and "skip or repeat samples" in str(info.value)
    with pytest.raises(ConfigError) as info:
        check_resumable("ck", saved, to_dict(parse_args(base)), "corpus-other")
    assert info.value.field == "data.files" and "data differs" in str(info.value)
    with pytest.raises(ConfigError) as info:  # no identity saved (older checkpoints): the settings decide
        check_resumable("ck", {"config": saved["config"]}, to_dict(parse_args(base + ["--data.vocab_size", "512"])), None)
    assert info.value.field == "data.vocab_size"


def test_resume_never_moves_the_previous_run_aside(tmp_path):
    """resume: never in a used folder keeps the old run (metrics, checkpoints, export) in
    previous_run_*/ instead of truncating its metrics and mixing its checkpoints with the new ones."""
    from memtrain.checkpoint.layout import move_previous_run

    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "notes.txt").write_text("the user's")
    (tmp_path / "oom_escaped.rank1.json").write_text("{}")  # would shrink the new run's plan
    (tmp_path / "faults_fired").mkdir()  # would stop the new run's faults from firing
    moved = move_previous_run(str(tmp_path))
    assert moved is not None and os.path.basename(moved).startswith("previous_run_")
    assert (tmp_path / moved / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / moved / "checkpoints" / "step_00000004").is_dir()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    assert (tmp_path / moved / "oom_escaped.rank1.json").exists() and (tmp_path / moved / "faults_fired").is_dir()
    assert not (tmp_path / "oom_escaped.rank1.json").exists() and not (tmp_path / "faults_fired").exists()
    assert (tmp_path / "notes.txt").exists()  # not a run output: left where it is
    assert move_previous_run(str(tmp_path)) is None  # nothing left to move
    assert move_previous_run(str(tmp_path / "new")) is None  # a first run's folder does not exist yet


def test_a_full_disk_is_named_with_free_bytes_and_path(tmp_path):
    import errno

    from memtrain.folders import write_error

    for exc in (OSError(errno.ENOSPC, "No space left on device"),
                RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4304")):
        message = write_error(exc, str(tmp_path / ".tmp-step_00000004"))
        assert "the disk is full" in message and "bytes free" in message and ".tmp-step_00000004" in message
    assert write_error(ValueError("bad"), str(tmp_path)) == "ValueError: bad"


def test_resume_refuses_another_placement_unless_auto_takes_the_checkpoints():
    """A checkpoint whose config records an offload (a run before the engine spec wrote the auto
    placement there): another explicit offload is refused by name; ``offload: auto`` takes it."""
    from memtrain.checkpoint.compat import ResumeRules
    from memtrain.levers import resume_rules

    check_resumable = ResumeRules.with_levers(resume_rules()).check  # as the loop checks
    from memtrain.config import ConfigError, parse_args, to_dict

    base = ["--config", "recipes/code_lm_tiny.yaml", "--backend.name", "deepspeed", "--backend.zero_stage", "3"]
    saved = {"config": to_dict(parse_args(base + ["--backend.offload", "optimizer",
                                                  "--backend.offload_optimizer_ratio", "0.5"])),
             "data_identity": "corpus-abc"}
    check_resumable("ck", saved, to_dict(parse_args(base + ["--backend.offload", "auto"])), "corpus-abc")
    with pytest.raises(ConfigError) as info:
        check_resumable("ck", saved, to_dict(parse_args(base + ["--backend.offload", "none"])), "corpus-abc")
    assert info.value.field == "backend.offload" and "'optimizer'" in str(info.value)
