"""The main job end to end on one process: metrics contract and a loadable exported model."""

import torch

from conftest import read_metrics, tiny_args
from memtrain.train import main

CONTRACT = {"step", "epoch", "loss", "lr", "grad_norm", "micro_batch_size", "gradient_accumulation_steps",
            "global_batch_size", "samples_seen", "tokens_per_s", "peak_memory_bytes", "batch_fingerprint"}


def test_tiny_recipe_metrics_and_export(tmp_path, cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = main(tiny_args(tmp_path, cache_dir, "--training.max_steps", "4", "--training.eval_every", "2"))
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert CONTRACT <= r.keys()
        assert r["micro_batch_size"] * r["gradient_accumulation_steps"] == r["global_batch_size"] == 8
        assert r["samples_seen"] == 8 * r["step"] and r["peak_memory_bytes"] > 0
    assert "val_loss" in records[1] and "val_loss" in records[3] and "val_loss" not in records[0]
    assert records == result.records  # the file holds exactly what the run produced
    assert len({r["batch_fingerprint"] for r in records}) == 4
    assert records[-1]["loss"] < records[0]["loss"]

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    trained = result.model.eval()
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=0, atol=0)
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert tok.decode(tok("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"
    assert loaded.config.eos_token_id == loaded.config.bos_token_id == tok.eos_token_id


def test_the_tiny_recipes_export_generates_past_its_training_length(tmp_path, cache_dir):
    """The tiny recipe's model (its own size keys) exported after one step: generate(max_new_tokens=200)
    from a prompt as long as a training sample runs (the recipe leaves positions to generate into)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    main(tiny_args(tmp_path, cache_dir, "--training.max_steps", "1", model=False))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    prompt = tok("def add(a, b):\n    return a + b\n" * 8, return_tensors="pt")["input_ids"][:, :32]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=200, min_new_tokens=200, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    assert out.shape == (1, 232)


def test_special_token_ids_come_from_the_tokenizer():
    """Not the model type's defaults (GPT-2's 50256), even where the vocabulary would hold them."""
    from memtrain.config import ModelConfig
    from memtrain.models import build_model

    cfg = ModelConfig(config={"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "n_positions": 8,
                              "vocab_size": 50304})
    model = build_model(cfg, vocab_size=512, eos_token_id=7)
    assert model.config.eos_token_id == model.config.bos_token_id == 7


def test_plain_module_factory(tmp_path, cache_dir):
    from safetensors.torch import load_file

    result = main(tiny_args(tmp_path, cache_dir, "--model.factory", "toy_models:make",
                            "--model.config", "{dim: 8}", "--training.max_steps", "2", model=False))
    state = load_file(tmp_path / "model" / "model.safetensors")
    assert state.keys() == result.model.state_dict().keys()
    for k, v in result.model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)
    assert len(read_metrics(tmp_path)) == 2


def test_same_seed_same_losses(tmp_path, cache_dir):
    a = main(tiny_args(tmp_path / "a", cache_dir, "--training.max_steps", "2")).records
    b = main(tiny_args(tmp_path / "b", cache_dir, "--training.max_steps", "2")).records
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_a_step_reads_the_device_at_most_as_documented(tmp_path, cache_dir, monkeypatch):
    """Host reads of tensors (``item``, ``tolist``, ``float``, ``int``, ``bool``: each a host
    synchronisation on a GPU) made by memtrain's code inside an optimizer step, counted by
    patching the tensor methods: at most :data:`memtrain.step.HOST_READS_PER_STEP` per step on one
    rank (the step's sums in one read, the engine's gradient norm)."""
    import sys

    from memtrain import loop
    from memtrain.step import HOST_READS_PER_STEP

    reads, steps, inside = [], [0], [False]

    def counting(original):
        def method(self, *args, **kwargs):
            frame = sys._getframe(1)
            if inside[0] and steps[0] > 1 and "/memtrain/" in frame.f_code.co_filename.replace("\\", "/"):
                reads.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
            return original(self, *args, **kwargs)
        return method

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    step = loop.TrainingLoop._optimizer_step

    def counted_step(self, *args):
        steps[0] += 1  # step 1 also checks once that every parameter got a gradient: not counted
        inside[0] = True
        try:
            return step(self, *args)
        finally:
            inside[0] = False

    monkeypatch.setattr(loop.TrainingLoop, "_optimizer_step", counted_step)
    main(tiny_args(tmp_path, cache_dir, "--training.max_steps", "3", "--training.micro_batch_size", "1"))
    assert len(reads) <= 2 * HOST_READS_PER_STEP, reads  # steps 2-3, 8 micro-batches each
    assert len(reads) >= 2  # the counter sees the step's reads (it would be blind otherwise)


def test_the_main_job_runs_without_the_extras_and_a_feature_names_its_extra(tmp_path, cache_dir):
    """As after `pip install -e .` alone (tests/without_extras.py: the extras' modules, pandas and
    pyarrow not found): the tiny main job trains and exports; TensorBoard stops the run naming
    memtrain[tracking] (exit 2); speech data is refused at validation naming memtrain[speech]."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import REPO, TRAIN

    without = str(Path(__file__).parent / "without_extras.py")

    def run(*args):
        return subprocess.run([sys.executable, without, TRAIN, *args], capture_output=True, text=True, cwd=REPO,
                              timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ok = run(*tiny_args(tmp_path / "run", cache_dir, "--training.max_steps", "2"))
    assert ok.returncode == 0 and (tmp_path / "run" / "model" / "model.safetensors").exists(), ok.stderr[-3000:]
    tracked = run(*tiny_args(tmp_path / "tracked", cache_dir, "--training.max_steps", "2", "--logging.log_with",
                             "[tensorboard]"))
    assert tracked.returncode == 2 and "pip install 'memtrain[tracking]'" in tracked.stderr, tracked.stderr[-2000:]
    speech = run("--config", str(REPO / "recipes" / "asr_ctc_wavlm_tiny.yaml"), "--output_dir", str(tmp_path / "sp"))
    assert speech.returncode == 2 and "config error in 'data.kind'" in speech.stderr
    assert "pip install 'memtrain[speech]'" in speech.stderr and not (tmp_path / "sp").exists()


def test_checkpoint_export_false_writes_no_export_and_a_rerun_misses_none(tmp_path, cache_dir, caplog):
    """``checkpoint.export false``: the run writes no ``model/`` (its summary says none), and a rerun
    of the finished run does not take the export for missing; with ``every_steps`` 0 the run warns
    at its start that the trained weights will not be kept."""
    import json

    args = tiny_args(tmp_path, cache_dir, "--training.max_steps", "2", "--checkpoint.export", "false",
                     "--checkpoint.every_steps", "2")
    main(args)
    assert not (tmp_path / "model").exists() and (tmp_path / "checkpoints").is_dir()
    assert json.loads((tmp_path / "summary.json").read_text())["model_dir"] is None
    caplog.clear()
    again = main(args)
    assert not (tmp_path / "model").exists() and again.records == []
    assert "already finished" in caplog.text and "making" not in caplog.text
    (tmp_path / "summary.json").unlink()  # a kill before the summary: the rerun makes it, and no export
    main(args)
    assert json.loads((tmp_path / "summary.json").read_text())["model_dir"] is None
    assert not (tmp_path / "model").exists()
    main(tiny_args(tmp_path / "b", cache_dir, "--training.max_steps", "1", "--checkpoint.export", "false"))
    assert "the trained weights will not be kept" in caplog.text and not (tmp_path / "b" / "model").exists()
