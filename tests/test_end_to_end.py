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
