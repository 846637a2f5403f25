"""Crash-safe checkpoints and exact resume on 2 CPU ranks (gloo, fp32) under DDP, FSDP2 (with and
without its optimizer offload), ZeRO-2 and ZeRO-3: an interrupted-and-resumed run trains bitwise like
one that never stopped."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import ENGINES, STEPS, child_exit_codes, launch, read_metrics, run_cli, tiny_args

pytestmark = pytest.mark.slow
LONG_STEPS = 2 * STEPS  # a kill at step 7 between checkpoints 6 and 9, and a resume with steps left
SAVES = ["--checkpoint.every_steps", "3", "--checkpoint.keep_last", "2"]
CKPT = ["--training.max_steps", str(LONG_STEPS), *SAVES]
CKPT_ENGINES = ["ddp", "fsdp", "zero2_offload_hf", "zero3", "zero2"]
EXACT = ("step", "loss", "lr", "grad_norm", "batch_fingerprint")


def continuous(reference, engine) -> Path:
    """The output folder of the uninterrupted 16-step run of ``engine`` (one per session)."""
    return reference(engine, LONG_STEPS, extra=tuple(SAVES))


def assert_bitwise_from(records, base, first_step):
    assert [r["step"] for r in records] == list(range(1, LONG_STEPS + 1))  # each step exactly once
    for r, b in zip(records[first_step - 1:], base[first_step - 1:]):
        for key in EXACT:
            assert r[key] == b[key], (r["step"], key, r[key], b[key])


def checkpoint_steps(out):
    return sorted(int(n[5:]) for n in os.listdir(out / "checkpoints") if n.startswith("step_"))


# mid-step kills here; after-step kills (and ZeRO-3) are in the elastic and two-node tests below
@pytest.mark.parametrize("engine,where", [("ddp", "mid_step"), ("fsdp", "mid_step"), ("zero2_offload_hf", "mid_step"),
                                          ("fsdp_offload_optimizer", "mid_step")])
def test_killed_and_resumed_run_is_bitwise_identical(tmp_path, reference, cache_dir, engine, where):
    base = read_metrics(continuous(reference, engine))
    kill = ["--faults.kill_at_step", "7"] + (["--faults.kill_mid_step", "true"] if where == "mid_step" else [])
    killed = launch(tiny_args(tmp_path, cache_dir, *CKPT, *ENGINES[engine], *kill), check=False)
    assert killed.returncode != 0
    assert checkpoint_steps(tmp_path) == [3, 6]
    assert read_metrics(tmp_path)[-1]["step"] == (7 if where == "after_step" else 6)
    launch(tiny_args(tmp_path, cache_dir, *CKPT, *ENGINES[engine], *kill))  # resume: auto; the kill fired already
    records = read_metrics(tmp_path)
    assert records[6]["event"].startswith("resume")  # step 7 is the first resumed step
    if engine == "zero2_offload_hf":  # the JSON's schedule, once per optimizer step, through the resume
        assert [r["lr"] for r in records] == deepspeed_warmup_decay_rates(lr=3e-3, warmup=2, total=LONG_STEPS)
        assert_cpu_adam_resume_from(records, base, 7)
    else:
        assert_bitwise_from(records, base, 7)


def assert_cpu_adam_resume_from(records, base, first_step):
    """Exact but for DeepSpeed's CPU Adam (optimizer offload): its C++ kernel keeps beta^t as a running
    product, which a resumed process starts again from pow(beta, step); that differs in the last
    float bits, so the same data and schedule give losses equal to ~1e-7 instead of bitwise."""
    assert [r["step"] for r in records] == list(range(1, LONG_STEPS + 1))
    for r, b in zip(records[first_step - 1:], base[first_step - 1:]):
        assert (r["lr"], r["batch_fingerprint"]) == (b["lr"], b["batch_fingerprint"])
        assert r["loss"] == pytest.approx(b["loss"], rel=1e-6) and r["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def deepspeed_warmup_decay_rates(lr, warmup, total):
    """DeepSpeed's own WarmupDecayLR, stepped once after each of ``total`` optimizer steps."""
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=0.0, warmup_max_lr=lr, warmup_num_steps=warmup)
    rates = []
    for _ in range(total):
        rates.append(opt.param_groups[0]["lr"])
        schedule.step()
    return rates


# c10d rendezvous: each restart gets a fresh store prefix (the static one would hand the restarted
# ranks the dead ranks' gloo addresses)
ELASTIC = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "127.0.0.1:{port}", "--max-restarts", "2", "--monitor-interval", "0.5"]
HANG_TIMEOUT_S = 30  # backend.timeout_s of the hang tests: well above any wait of a healthy tiny run


# ZeRO-3 (collectives inside compute): a kill inside a step, then a hang; a kill after a step under
# DDP restarts the same way (the two-node test below kills a rank under DDP too)
@pytest.mark.heavy
@pytest.mark.parametrize("engine,where,hang", [("zero3", "mid_step", True)])
def test_elastic_restarts_survive_a_killed_and_a_hung_rank(tmp_path, reference, cache_dir, engine, where, hang):
    """Under ``torchrun --max-restarts 2``: rank 1 is killed in step 7 and (``hang``) later rank 0
    hangs inside step 11. Each time the other rank's collective fails (or the hung rank's watchdog
    fires) within backend.timeout_s, torchrun restarts both, they resume from the last checkpoint,
    and the finished run's every step equals the continuous run's bitwise."""
    import time

    base = read_metrics(continuous(reference, engine))
    faults = ["--faults.kill_at_step", "7", "--faults.kill_ranks", "[1]", "--backend.timeout_s", str(HANG_TIMEOUT_S)]
    faults += ["--faults.hang_at_step", "11", "--faults.hang_ranks", "[0]"] if hang else []
    faults += ["--faults.kill_mid_step", "true"] if where == "mid_step" else []
    start = time.perf_counter()
    proc = launch(tiny_args(tmp_path, cache_dir, *CKPT, *ENGINES[engine], *faults), launcher=ELASTIC, timeout=400)
    assert time.perf_counter() - start < 300
    records = read_metrics(tmp_path)
    resumes = [r.get("event", "").split(",")[0] for r in records if r.get("event", "").startswith("resume")]
    assert resumes == ["resume"] * (2 if hang else 1)
    assert_bitwise_from(records, base, 1)
    fired = ["kill_at_step_7.rank1"]
    if hang:  # the hang ended by a timeout naming the rank and where it was, not by the test's deadline
        assert "rank 0: no progress for" in proc.stderr or "rank 1: a collective failed during step 11" in proc.stderr
        assert "step 11: micro-batch" in proc.stderr
        fired.insert(0, "hang_at_step_11.rank0")
    assert sorted(os.listdir(tmp_path / "faults_fired")) == fired


@pytest.mark.parametrize("engine", ["ddp", "fsdp", "zero2", "zero3"])
def test_kill_during_save_then_corrupt_newest_falls_back(tmp_path, reference, cache_dir, engine):
    """A save killed half-way leaves no checkpoint (its temporary directory is removed on start);
    a corrupted file in the newest complete checkpoint is refused by name; resume: auto takes the
    one before, and the run still ends exactly like the continuous one."""
    base = read_metrics(continuous(reference, engine))
    killed = launch(tiny_args(tmp_path, cache_dir, *CKPT, *ENGINES[engine], "--faults.kill_during_save", "9"),
                    check=False)
    assert killed.returncode != 0
    assert checkpoint_steps(tmp_path) == [3, 6]
    assert (tmp_path / "checkpoints" / ".tmp-step_00000009").is_dir()  # the half-written save
    newest = tmp_path / "checkpoints" / "step_00000006"
    victim = max((p for p in newest.rglob("*") if p.is_file() and p.name != "manifest.json"),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    resumed = launch(tiny_args(tmp_path, cache_dir, *CKPT, *ENGINES[engine]))
    assert str(victim) in resumed.stderr and "corrupt" in resumed.stderr
    assert ".tmp-step_00000009" in resumed.stderr  # named when removed
    records = read_metrics(tmp_path)
    assert "resume" in records[3]["event"] and records[3]["plan_changes"][0]["from"].endswith("step_00000003")
    assert_bitwise_from(records, base, 4)


@pytest.mark.parametrize("engine", CKPT_ENGINES)
def test_export_round_trip(tmp_path, reference, cache_dir, engine):
    """``memtrain export`` of the final checkpoint loads with transformers and gives the same
    logits as the model the run exported itself."""
    from transformers import AutoModelForCausalLM

    from memtrain.export import main as export_main

    out = continuous(reference, engine)
    assert checkpoint_steps(out) == [15, 16]  # keep_last 2; the last step is always saved
    assert export_main([str(out / "checkpoints"), str(tmp_path / "exported")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    trained = AutoModelForCausalLM.from_pretrained(out / "model")
    ids = torch.randint(0, exported.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, rtol=0, atol=0)


def test_export_refuses_corrupt_checkpoint(tmp_path, reference, cache_dir):
    from memtrain.export import main as export_main

    ckpt = tmp_path / "step"
    shutil.copytree(continuous(reference, "ddp") / "checkpoints" / "step_00000016", ckpt)
    (ckpt / "optimizer.pt").write_bytes(b"garbage")
    assert export_main([str(ckpt), str(tmp_path / "exported")]) == 2
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("engine", ["ddp", "fsdp", "zero2_offload_hf", "zero3"])
def test_resume_two_rank_checkpoint_on_one_rank(tmp_path, reference, cache_dir, engine):
    """The cursor is world-size independent: a 2-rank checkpoint resumed by 1 rank (same global
    batch) continues with the same samples and the same losses (to float summation order);
    ZeRO partitions go through DeepSpeed's universal checkpoint, converted on resume."""
    base = read_metrics(continuous(reference, engine))
    shutil.copytree(continuous(reference, engine) / "checkpoints" / "step_00000015",
                    tmp_path / "from")
    launch(tiny_args(tmp_path / "run", cache_dir, *CKPT, *ENGINES[engine], "--resume", str(tmp_path / "from")), nproc=1)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [16]
    assert records[0]["batch_fingerprint"] == base[15]["batch_fingerprint"]
    assert records[0]["loss"] == pytest.approx(base[15]["loss"], rel=1e-5)
    if engine.startswith("zero"):  # Adam's moments came across too: step 16's update, hence the weights, match
        from safetensors.torch import load_file

        ours = load_file(tmp_path / "run" / "model" / "model.safetensors")
        theirs = load_file(continuous(reference, engine) / "model" / "model.safetensors")
        for name, tensor in theirs.items():
            torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-6)
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]  # the converted copy is gone


def test_a_resumed_run_writes_the_checkpoint_format_it_chose(tmp_path, reference, cache_dir):
    """``checkpoint.format dcp`` under DDP: 1 rank resumes the 2-rank run's safetensors checkpoint
    of step 15 (read by the format its manifest names, as another format's whole state), trains
    step 16 on the same samples with the same loss, and saves dcp's files, named in the manifest;
    a format DDP's model cannot be saved in is refused naming the field and the choices."""
    from memtrain.checkpoint.layout import read_manifest

    base = read_metrics(continuous(reference, "ddp"))
    shutil.copytree(continuous(reference, "ddp") / "checkpoints" / "step_00000015", tmp_path / "from")
    launch(tiny_args(tmp_path / "run", cache_dir, *CKPT, *ENGINES["ddp"], "--checkpoint.format", "dcp",
                     "--resume", str(tmp_path / "from")), nproc=1)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [16]
    assert records[0]["batch_fingerprint"] == base[15]["batch_fingerprint"]
    assert records[0]["loss"] == pytest.approx(base[15]["loss"], rel=1e-5)
    saved = tmp_path / "run" / "checkpoints" / "step_00000016"
    assert read_manifest(str(saved))["checkpoint_format"] == "dcp" and (saved / "dcp" / ".metadata").exists()
    assert not list(saved.glob("*.safetensors")) and not (saved / "optimizer.pt").exists()
    refused = run_cli(tiny_args(tmp_path / "bad", cache_dir, "--checkpoint.format", "deepspeed"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "'checkpoint.format': 'deepspeed' cannot be written by engine ddp: choose auto or dcp, safetensors" in refused.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("source,target,nproc", [("ddp", "fsdp", 2), ("fsdp", "ddp", 2), ("zero2", "ddp", 2),
                                                  ("ddp", "zero3", 2), ("fsdp", "zero3", 1)])
def test_a_killed_run_resumes_under_another_engine(tmp_path, reference, cache_dir, source, target, nproc):
    """DDP ↔ FSDP2, ZeRO-2 → DDP, DDP → ZeRO-3 and FSDP2 → ZeRO-3 (on 1 rank: another world
    size too): a run
    killed after step 5 and rerun with the other engine resumes its step-3 checkpoint and trains
    steps 4–16 on the same samples (same ``batch_fingerprint``) with the losses of the run that
    never switched (within the 1e-4 at which the engines agree); Adam's moments and step counts
    came across, so the exported weights after 13 more updates match too. The switch is in the
    log and the resume event; a conversion folder beside the checkpoints is gone."""
    base_dir = continuous(reference, source)
    base = read_metrics(base_dir)
    kill = ["--faults.kill_at_step", "5"]
    assert launch(tiny_args(tmp_path, cache_dir, *CKPT, *ENGINES[source], *kill), check=False).returncode != 0
    assert checkpoint_steps(tmp_path) == [3]
    # resume auto; the kill fired already
    proc = launch(tiny_args(tmp_path, cache_dir, *CKPT, *ENGINES[target], *kill), nproc=nproc, timeout=420)
    engine = lambda name: "deepspeed" if name.startswith("zero") else name  # noqa: E731
    assert f"resuming a {engine(source)} checkpoint under {engine(target)}" in proc.stderr
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, LONG_STEPS + 1))  # each step once
    assert records[3]["event"] == "resume,engine_switch"
    assert records[3]["plan_changes"][0]["changed"]["backend.name"] == [engine(source), engine(target)]
    assert records[3]["plan_changes"][1] == {"event": "engine_switch", "step": 4, "from": engine(source),
                                             "to": engine(target)}
    for r, b in zip(records[3:], base[3:]):
        assert r["batch_fingerprint"] == b["batch_fingerprint"], r["step"]
        assert r["loss"] == pytest.approx(b["loss"], rel=1e-4), r["step"]
    from safetensors.torch import load_file

    ours, theirs = load_file(tmp_path / "model" / "model.safetensors"), load_file(base_dir / "model" / "model.safetensors")
    common = ours.keys() & theirs.keys()  # a tied weight (GPT-2's lm_head) is stored once by DDP's export
    assert common in (ours.keys(), theirs.keys()) and len(common) > 1
    for name in common:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5)
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith(".tmp-")]


def test_another_engines_checkpoint_is_refused_under_partial_offload_by_name(tmp_path):
    """DeepSpeed's universal loader has no partial or NVMe optimizer offload: taking another
    engine's state there stops with a CheckpointError naming the setting, before anything is
    written beside the checkpoint."""
    from memtrain.backends.deepspeed import DeepSpeedBackend
    from memtrain.errors import CheckpointError

    backend = object.__new__(DeepSpeedBackend)  # the refusal comes before the engine is needed
    backend.offload_ratio, backend.nvme = 0.5, False
    with pytest.raises(CheckpointError, match="backend.offload_optimizer_ratio 1.0"):
        backend.load_full_state(torch.nn.Linear(2, 2), None, {}, {"state": {}}, str(tmp_path / "step_00000003"))
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_of_another_model_is_refused_naming_the_model_config_key(tmp_path):
    """Resuming with another layer count: the refusal names ``model.config.n_layer`` with both
    values (read from the manifest's config and the model's own), then the first parameter whose
    shape differs, and loads nothing."""
    import types

    from transformers import GPT2Config, GPT2LMHeadModel

    from memtrain.checkpoint.stateful import EngineState, model_shapes
    from memtrain.errors import CheckpointError

    small = dict(n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    saved_model, this_model = GPT2LMHeadModel(GPT2Config(n_layer=2, **small)), GPT2LMHeadModel(GPT2Config(n_layer=1, **small))
    backend = types.SimpleNamespace(name="ddp", checkpoint_io=types.SimpleNamespace(NAME="safetensors"),
                                    manifest_fields=dict, unwrap=lambda m: m)
    backend.load_state = lambda *a: pytest.fail("a checkpoint of another model was loaded")
    manifest = {"backend": "ddp", "checkpoint_format": "safetensors", "model_shapes": model_shapes(saved_model),
                "config": {"model": {"config": {"model_type": "gpt2", "n_layer": 2, **small}}}}
    with pytest.raises(CheckpointError) as info:
        EngineState(backend, this_model, None).load_files(str(tmp_path), manifest)
    assert "(model.config.n_layer: checkpoint 2, this run 1), first at parameter transformer.h.1." in str(info.value)
    assert "this run none (no such parameter)" in str(info.value)


def test_explicit_corrupt_checkpoint_is_refused_by_name(tmp_path, reference, cache_dir):
    ckpt = tmp_path / "step"
    shutil.copytree(continuous(reference, "ddp") / "checkpoints" / "step_00000015", ckpt)
    victim = ckpt / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:-7])
    proc = launch(tiny_args(tmp_path / "run", cache_dir, *CKPT, "--resume", str(ckpt)), launcher=[sys.executable],
                  check=False)
    assert proc.returncode == 4
    assert f"{victim} has" in proc.stderr and "truncated" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "run")


def test_manifest_lists_every_file_with_checksum(reference):
    ckpt = continuous(reference, "fsdp") / "checkpoints" / "step_00000016"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    on_disk = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(manifest["files"]) == on_disk
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "rank_00000.pt", "rank_00001.pt"} <= set(on_disk)
    assert manifest["world_size"] == 2 and manifest["backend"] == "fsdp" and manifest["step"] == 16
    assert (ckpt.parent / "latest").read_text().strip() == "step_00000016"


def test_rank_divergent_buffer_is_named_at_save(tmp_path, cache_dir):
    proc = launch(tiny_args(tmp_path, cache_dir, "--training.max_steps", "2", "--checkpoint.every_steps", "2",
                            "--backend.name", "fsdp", "--model.factory", "toy_models:make_rank_local_stats", "--model.config", "{}",
                            model=False))
    assert "replicated tensor(s) differ between ranks, first: buffer input_stats" in proc.stderr


_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}


def _signal_after(args: list[str], output_dir, steps: int, signum):
    """Start one training process, send it ``signum`` once ``steps`` records are written, and
    wait for it; returns (the finished process, its stdout, its stderr)."""
    import subprocess
    import time

    from conftest import REPO, TRAIN

    proc = subprocess.Popen([sys.executable, TRAIN, *args], env=_ENV, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = output_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        time.sleep(0.05)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    return proc, out, err


def test_sigterm_saves_and_resume_matches(tmp_path, reference, cache_dir):
    """SIGTERM (as SLURM/Kubernetes send) to the launcher: the ranks finish the step, save it and
    stop; rerunning the command continues exactly."""
    import signal

    base = read_metrics(continuous(reference, "ddp"))
    args = tiny_args(tmp_path, cache_dir, *CKPT, *ENGINES["ddp"], "--checkpoint.every_steps", "0")
    proc, out, err = _signal_after(args, tmp_path, 3, signal.SIGTERM)
    assert proc.returncode == 0, err[-3000:]
    stopped = read_metrics(tmp_path)[-1]["step"]
    assert stopped < LONG_STEPS and checkpoint_steps(tmp_path) == [stopped]
    assert out.count("SIGTERM") == 1 and f"stopped by SIGTERM after step {stopped}, saved; rerun" in out  # said once
    launch(tiny_args(tmp_path, cache_dir, *CKPT, *ENGINES["ddp"]), nproc=1)
    # one process here, two in the baseline: same samples, same losses to summation order
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, LONG_STEPS + 1))
    assert [r["batch_fingerprint"] for r in records] == [b["batch_fingerprint"] for b in base]
    for r, b in zip(records, base):
        assert r["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_fsdp_async_save_resumes_exactly(tmp_path, reference, cache_dir):
    """checkpoint.async_save (FSDP2: torch.distributed.checkpoint.async_save in the background,
    committed once every rank's write finished) trains and resumes like synchronous saving."""
    base = read_metrics(continuous(reference, "fsdp"))
    args = [*CKPT, *ENGINES["fsdp"], "--checkpoint.async_save", "true"]
    killed = launch(tiny_args(tmp_path, cache_dir, *args, "--faults.kill_at_step", "8"), check=False)
    assert killed.returncode != 0
    committed = checkpoint_steps(tmp_path)
    assert committed and committed[-1] in (3, 6)  # step 6's write commits at step 7 or 8 when done
    launch(tiny_args(tmp_path, cache_dir, *args))
    records = read_metrics(tmp_path)
    assert_bitwise_from(records, base, 1)
    manifest = json.loads((tmp_path / "checkpoints" / "step_00000016" / "manifest.json").read_text())
    assert "dcp/.metadata" in manifest["files"]


def test_resumed_run_starts_with_the_plan_that_worked(tmp_path, cache_dir):
    """The micro-batch plan is part of the checkpoint: after an OOM shrank it, a resumed run
    starts at the smaller plan instead of running out of memory again."""
    args = [*CKPT, "--training.max_steps", "4", "--checkpoint.every_steps", "2", *ENGINES["ddp"],
            "--faults.oom_above_tokens", "32", "--memory.grow_back_window", "0"]
    launch(tiny_args(tmp_path, cache_dir, *args, "--faults.kill_at_step", "3"), check=False)
    assert read_metrics(tmp_path)[0]["event"] == "oom_shrink"
    launch(tiny_args(tmp_path, cache_dir, *args))
    records = read_metrics(tmp_path)
    assert records[2]["event"] == "resume"  # no oom_shrink: the saved plan was used
    assert [r["micro_batch_size"] for r in records] == [1, 1, 1, 1]


def test_write_failure_on_one_rank_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path, cache_dir):
    """A save that fails on rank 1 only (disk full, permissions…) is reported on every rank —
    nobody waits forever for rank 1 — and the previous checkpoint stays the latest."""
    common = [*CKPT, "--checkpoint.every_steps", "2", *ENGINES["ddp"]]
    launch(tiny_args(tmp_path, cache_dir, *common, "--training.max_steps", "2"))  # a good checkpoint at step 2
    proc = launch(tiny_args(tmp_path, cache_dir, *common, "--training.max_steps", "4",
                            "--faults.save_error_ranks", "[1]"), timeout=120, check=False)
    # a checkpoint that cannot be saved: exit 4; a rank still shutting down when the launcher saw the
    # other's exit is stopped by it (SIGTERM, -15), as torchrun does, after it said the error
    codes = child_exit_codes(proc)
    assert proc.returncode != 0 and 4 in codes and codes <= {4, -15}, codes
    # both ranks stop with rank 1's error (rank 0 learnt of it instead of waiting)
    assert proc.stderr.count("saving step 4 failed (rank 1: OSError: faults.save_error_ranks") == 2
    assert checkpoint_steps(tmp_path) == [2]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_ctrl_c_saves_and_exits_130(tmp_path, cache_dir):
    """SIGINT (Ctrl-C) like SIGTERM: the step finishes and is saved; then exit 130, no traceback."""
    import signal

    args = tiny_args(tmp_path, cache_dir, *CKPT, "--checkpoint.every_steps", "0")
    proc, out, err = _signal_after(args, tmp_path, 2, signal.SIGINT)
    assert proc.returncode == 130, err[-3000:]
    stopped = read_metrics(tmp_path)[-1]["step"]
    assert stopped < LONG_STEPS and checkpoint_steps(tmp_path) == [stopped]
    assert out.count("SIGINT") == 1 and f"stopped by SIGINT after step {stopped}, saved" in out  # said once
    assert "Traceback" not in err
    # resuming that checkpoint with another global batch would skip samples: refused by name
    proc = run_cli([*args, "--training.global_batch_size", "16"], timeout=120)
    assert proc.returncode == 2 and "training.global_batch_size" in proc.stderr and "Traceback" not in proc.stderr
    assert checkpoint_steps(tmp_path) == [stopped]


def test_second_ctrl_c_stops_at_once():
    """The handler: a first SIGINT asks for a saved stop, a second raises KeyboardInterrupt."""
    import signal

    from memtrain.preemption import Preemption

    preemption = Preemption()
    try:
        preemption._handle(signal.SIGTERM, None)
        preemption._handle(signal.SIGINT, None)  # the first Ctrl-C, after a SIGTERM: still a saved stop
        assert preemption.requested and preemption.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            preemption._handle(signal.SIGINT, None)
    finally:
        preemption.close()


def test_two_torchrun_agents_as_two_nodes_match_one_node_and_survive_a_kill(tmp_path, reference, cache_dir):
    """Multi-node as two torchrun agents on localhost (``--nnodes 2 --nproc_per_node 1``, c10d
    rendezvous, ``--max-restarts 1``): rank 1 (the second "node") is killed after step 7, both
    agents restart their worker, it resumes, and every step equals the one-node 2-process run
    bitwise."""
    import subprocess

    from conftest import REPO, TRAIN, _free_port

    base = read_metrics(continuous(reference, "ddp"))
    port = _free_port()
    args = tiny_args(tmp_path, cache_dir, *CKPT, *ENGINES["ddp"], "--faults.kill_at_step", "7",
                     "--faults.kill_ranks", "[1]", "--backend.timeout_s", "60")
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes",
             "--max-restarts", "1", "--monitor-interval", "0.5", TRAIN, *args]
    env = {**_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a fresh store each round, as the README says
    agents = [subprocess.Popen(agent, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], [err[-3000:] for _, err in outputs]
    records = read_metrics(tmp_path)
    assert records[6]["event"].startswith("resume")
    assert_bitwise_from(records, base, 1)
    assert os.listdir(tmp_path / "faults_fired") == ["kill_at_step_7.rank1"]
