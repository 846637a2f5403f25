"""One interface, three engines: the same run under DDP, FSDP2 and DeepSpeed ZeRO 1/2/3 (+offload)
on 2 CPU ranks gives the same losses, whichever launcher starts it."""

import sys

import pytest
import torch

from conftest import ENGINES, REPO, STEPS, TORCHRUN, launch, read_metrics, tiny_args

pytestmark = pytest.mark.slow
RUN = ["--training.max_steps", str(STEPS)]
MATCHED = ["fsdp", "fsdp_keep_gathered", "fsdp_offload_optimizer", "zero1", "zero2", "zero3",
           "zero3_partial_offload"]  # each against DDP


@pytest.fixture(scope="module")
def ddp_out(reference):
    """The output folder of the shared 2-rank DDP reference run (metrics, summary, export)."""
    return reference("ddp")


@pytest.fixture(scope="module")
def ddp_run(ddp_out):
    return read_metrics(ddp_out)


def _assert_matches_ddp(records, ddp):
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["loss"] == ddp[0]["loss"]  # same seed, same weights, same batch: identical
    for r, ref in zip(records, ddp):
        assert r["batch_fingerprint"] == ref["batch_fingerprint"] and r["lr"] == ref["lr"]
        assert r["micro_batch_size"] == 2 and r["gradient_accumulation_steps"] == 2
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)


def _saved_names(folder) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as fh:
        return sorted(fh.keys())


@pytest.mark.parametrize("engine", MATCHED)
def test_engine_matches_ddp(tmp_path, cache_dir, ddp_out, ddp_run, engine):
    proc = launch(tiny_args(tmp_path, cache_dir, *RUN, *ENGINES[engine]), launcher=TORCHRUN, timeout=420)
    name = "fsdp" if engine.startswith("fsdp") else "deepspeed"
    assert f"memtrain: {name} × 2 rank(s)" in proc.stdout + proc.stderr
    for noise in ("is deprecated", "Setting accelerator to CPU", "[transformers] Model config"):  # nothing to act on
        assert noise not in proc.stderr
    _assert_matches_ddp(read_metrics(tmp_path), ddp_run)
    # the export holds the names DDP's does: GPT-2's tied head (lm_head.weight = wte.weight) stored once
    assert _saved_names(tmp_path / "model") == _saved_names(ddp_out / "model")
    assert not {"lm_head.weight", "transformer.wte.weight"} <= set(_saved_names(ddp_out / "model"))
    if engine == "zero3_partial_offload":  # the lever took effect: both optimizers step a share
        import re

        on_device, groups = map(int, re.search(r"partial offload: (\d+) of (\d+) optimizer", proc.stderr).groups())
        assert 0 < on_device < groups
    if engine == "fsdp_offload_optimizer":  # the last half of the parameters step on the host, the rest on the device
        import re

        host, params, share = map(int, re.search(r"optimizer offload: (\d+) of (\d+) parameters \((\d+)%",
                                                 proc.stderr).groups())
        assert 0 < host < params and 50 <= share < 60 and "stepped on the CPU beside the next forward" in proc.stderr


def test_optimizer_offload_in_bf16_matches_ddp(tmp_path, cache_dir, reference):
    """FSDP2's optimizer offload under bf16: bf16 parameter shards with an fp32 master, half of it on
    the host, against DDP's bf16 autocast over fp32 parameters: the same data and schedule, losses
    within bf16's rounding (1e-3), gradient norms within 2%."""
    ddp = read_metrics(reference("ddp", extra=("--precision", "bf16")))
    launch(tiny_args(tmp_path, cache_dir, *RUN, *ENGINES["fsdp_offload_optimizer"], "--precision", "bf16"))
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r, ref in zip(records, ddp):
        assert r["batch_fingerprint"] == ref["batch_fingerprint"] and r["lr"] == ref["lr"]
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-3)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2e-2)


@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_chunked_cross_entropy_and_activation_offload_match_ddp(tmp_path, cache_dir, ddp_run, engine):
    """memory.chunked_cross_entropy and memory.activation_offload together, under the engines that
    gather parameters only around their use (FSDP2's and ZeRO-3's hooks; the output layer's weight
    tied to the embedding): the plain DDP run's losses and data, and the simulated device counted
    the offloaded activations as host memory (the offload alone keeps losses bitwise:
    test_activation_offload)."""
    launch(tiny_args(tmp_path, cache_dir, *RUN, *ENGINES[engine], "--memory.chunked_cross_entropy", "true",
                     "--memory.activation_offload", "on", "--faults.memory_budget_mib", "1000"), timeout=420)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r, ref in zip(records, ddp_run):
        assert r["batch_fingerprint"] == ref["batch_fingerprint"]
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
        assert r["chunked_cross_entropy"] and r["activation_offload"] == "on" and r["simulated_host_peak_bytes"] > 0


def test_fine_tuning_the_export_continues_at_its_loss_under_zero3(tmp_path, cache_dir, ddp_out):
    """model.pretrained: the DDP run's export (weights, config, tokenizer) loaded under ZeRO-3
    evaluates to the loss the DDP run ended with, and trains on."""
    import json

    launch(tiny_args(tmp_path, cache_dir, "--training.max_steps", "2", *ENGINES["zero3"], "--model.pretrained",
                     str(ddp_out / "model")))
    before = json.loads((ddp_out / "summary.json").read_text())
    after = json.loads((tmp_path / "summary.json").read_text())
    assert after["initial_val_loss"] == pytest.approx(before["final_val_loss"], rel=1e-5)
    assert after["initial_val_loss"] < before["initial_val_loss"] - 0.05  # trained weights, not a fresh init
    from tokenizers import Tokenizer

    vocab = [Tokenizer.from_file(str(d / "model" / "tokenizer.json")).get_vocab() for d in (ddp_out, tmp_path)]
    assert vocab[0] == vocab[1]  # its tokenizer, not a newly trained one


def test_deepspeed_launcher_with_zero2_json(tmp_path, cache_dir, ddp_run):
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "{port}"]
    proc = launch(tiny_args(tmp_path, cache_dir, *RUN, "--deepspeed", str(REPO / "ds_configs" / "zero2.json")),
                  launcher=launcher, timeout=420)
    assert "memtrain: deepspeed × 2 rank(s)" in proc.stdout + proc.stderr
    _assert_matches_ddp(read_metrics(tmp_path), ddp_run)


@pytest.mark.parametrize("accelerate_config,engine", [("deepspeed_zero2.yaml", "deepspeed"), ("fsdp2.yaml", "fsdp")])
def test_accelerate_launch_with_engine_config(tmp_path, cache_dir, ddp_run, accelerate_config, engine):
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(REPO / "recipes" / "accelerate" / accelerate_config), "--main_process_port", "{port}"]
    proc = launch(tiny_args(tmp_path, cache_dir, *RUN), launcher=launcher, env={"ACCELERATE_USE_CPU": "1"},
                  timeout=420)
    assert f"memtrain: {engine} × 2 rank(s)" in proc.stdout + proc.stderr
    _assert_matches_ddp(read_metrics(tmp_path), ddp_run)


def test_layerdrop_model_trains_under_ddp(tmp_path, cache_dir):
    """Layers skipped at random leave parameters unused (DDP copes), and each rank draws its own
    random numbers (dropout and LayerDrop masks differ across ranks on different data)."""
    import re

    from safetensors.torch import load_file

    proc = launch(tiny_args(tmp_path, cache_dir, "--training.max_steps", "6", "--backend.name", "ddp",
                            "--model.factory", "toy_models:make_layerdrop", "--model.config", "{layerdrop: 0.5}",
                            model=False), launcher=TORCHRUN)
    # OOM recovery's deferred reduction fills missing gradients itself: no DDP reducer to search
    # (DDP's own reducer turns its search on: test_speech's ddp_reducer)
    assert "find_unused_parameters=True" not in proc.stderr and "received no gradient" not in proc.stderr
    assert "Setting accelerator to CPU" not in proc.stderr  # a DDP run says nothing of DeepSpeed
    assert len(read_metrics(tmp_path)) == 6
    assert int(load_file(tmp_path / "model" / "model.safetensors")["drops"]) > 0  # layers were really skipped
    draws = dict(re.findall(r"first random draw on rank (\d): ([0-9.]+)", proc.stderr))
    assert set(draws) == {"0", "1"} and draws["0"] != draws["1"]


def test_never_used_parameter_is_named(tmp_path, cache_dir):
    """DDP's own overlapped reduction cannot handle it: a clear error with the names. With OOM
    recovery's deferred reduction it is reduced as zeros and named in a warning."""
    args = ["--training.max_steps", "3", "--backend.name", "ddp", "--model.factory", "toy_models:make_unused",
            "--model.config", "{}"]
    proc = launch(tiny_args(tmp_path / "native", cache_dir, *args, "--memory.oom_recovery", "false", model=False),
                  check=False)
    assert proc.returncode != 0
    assert "forgotten.weight" in proc.stderr and "backend.find_unused_parameters" in proc.stderr
    proc = launch(tiny_args(tmp_path / "deferred", cache_dir, *args, model=False))
    assert "received no gradient on step 1: forgotten.weight" in proc.stderr
    assert len(read_metrics(tmp_path / "deferred")) == 3


def test_rank_divergent_buffer_is_made_equal_before_step_1(tmp_path, cache_dir):
    """2 ranks with a per-rank random buffer train exactly like 1 rank holding rank 0's buffer."""
    args = ["--training.max_steps", "3", "--backend.name", "ddp", "--model.factory", "toy_models:make_planted",
            "--model.config", "{}"]
    two = launch(tiny_args(tmp_path / "two", cache_dir, *args, model=False))
    assert "buffer planted" in two.stderr
    launch(tiny_args(tmp_path / "one", cache_dir, *args, model=False), nproc=1)
    for a, b in zip(read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.parametrize("engine,dtype", [("fsdp", "bf16"), ("ddp", "int8")])
def test_lossy_optimizer_state_trains_near_fp32_and_resumes_exactly(tmp_path, cache_dir, ddp_run, engine, dtype):
    """optimizer.state_dtype bf16 (FSDP2: DTensor moments in a DCP checkpoint) and int8 (DDP:
    torchao's quantized moments through optimizer.pt): the same data and first loss as the fp32
    DDP run, every loss within 1% of it but not all equal (the moments are rounded), the checkpoint
    holding the moments in that dtype, and a run killed after step 6 resuming from step 4 to the
    same losses bitwise."""
    import json
    import shutil

    if dtype == "int8":
        pytest.importorskip("torchao.optim")
    args = tiny_args(tmp_path, cache_dir, *RUN, "--backend.name", engine, "--optimizer.state_dtype", dtype,
                     "--checkpoint.every_steps", "4")
    launch(args + ["--faults.kill_at_step", "6"], check=False, timeout=420)
    killed = {r["step"]: r for r in read_metrics(tmp_path) if "loss" in r}
    assert max(killed) == 6
    shutil.copytree(tmp_path / "checkpoints" / "step_00000004", tmp_path.parent / f"{tmp_path.name}-step4")
    launch(args, timeout=420)
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    for step in (5, 6):
        assert (records[step - 1]["loss"], records[step - 1]["grad_norm"]) == (killed[step]["loss"], killed[step]["grad_norm"])
    assert [r["batch_fingerprint"] for r in records] == [r["batch_fingerprint"] for r in ddp_run]
    assert records[0]["loss"] == ddp_run[0]["loss"]
    assert all(r["loss"] == pytest.approx(ref["loss"], rel=0.01) for r, ref in zip(records, ddp_run))
    assert any(r["loss"] != ref["loss"] for r, ref in zip(records, ddp_run))
    assert json.loads((tmp_path / "summary.json").read_text())["config"]["optimizer"]["state_dtype"] == dtype
    saved = tmp_path.parent / f"{tmp_path.name}-step4"
    if engine == "fsdp":
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(str(saved / "dcp")).read_metadata().state_dict_metadata
        moments = [m.properties.dtype for k, m in meta.items() if k.endswith(".exp_avg")]
        assert moments and all(d == torch.bfloat16 for d in moments)
    else:
        state = torch.load(saved / "optimizer.pt", weights_only=True)["optimizer"]["state"]
        assert any(type(s["exp_avg"]).__name__ == "OptimState8bit" for s in state.values())
