"""Fine-tune a model memtrain exported with LoRA adapters you make with ``peft``, from Python.

The exported model (``output_dir/model``) is loaded with transformers, given rank-8 adapters on
its attention projections with ``peft.get_peft_model`` and passed to :class:`memtrain.Trainer`:
only the adapters train (gradients and optimizer state for them alone, which the planner counts),
and the run's export is the merged model, which transformers loads without peft. The data is
``finetune_exported.py``'s (the source of Python's ``json`` and ``email`` packages).

    memtrain --config recipes/code_lm_tiny.yaml --data.max_bytes 1000000 --training.max_steps 20 \\
        --output_dir runs/code_lm_small
    python examples/finetune_lora.py runs/code_lm_small/model --output_dir runs/code_lm_small_lora

The same adapters from the command line, without writing Python: ``--model.lora_rank 8``
(docs/configuration.md).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # memtrain from this clone

import memtrain  # noqa: E402
from finetune_exported import DEFAULTS, package_text, token_samples  # noqa: E402 (beside this file)

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("--"):
        sys.exit("usage: python examples/finetune_lora.py EXPORTED_MODEL_DIR [--section.key value ...]")
    pretrained, args = sys.argv[1], sys.argv[2:]
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pretrained)
    split = token_samples(package_text(["json", "email"]), tokenizer).train_test_split(test_size=0.1, seed=0)
    torch.manual_seed(0)  # every rank builds the same adapters
    base = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True,
                                            task_type="CAUSAL_LM"))
    settings = {**DEFAULTS, "output_dir": "runs/code_lm_small_lora", "training": {**DEFAULTS["training"], "lr": 3e-3}}
    trainer = memtrain.Trainer(settings, model=model, train_dataset=split["train"], eval_dataset=split["test"],
                               tokenizer=tokenizer, args=args)
    result = trainer.fit()
    first, last = result.summary["initial_val_loss"], result.summary["final_val_loss"]
    if int(os.environ.get("RANK", "0")) == 0 and first is not None and last is not None:
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"validation loss {first:.3f} -> {last:.3f} per token, {trained:,} of "
              f"{sum(p.numel() for p in model.parameters()):,} parameters trained; merged model in "
              f"{trainer.config.output_dir}/model")
