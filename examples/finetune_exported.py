"""Fine-tune a model memtrain exported on a ``datasets.Dataset`` you build, from Python.

An export (``output_dir/model``: model.safetensors, config.json, the tokenizer) loads with
``--model.pretrained``; the dataset here is the source of Python's ``json`` and ``email``
packages, tokenized with the export's tokenizer and cut into samples of ``SEQ_LEN`` tokens, a
tenth of them held out for validation.

    memtrain --config recipes/code_lm_tiny.yaml --data.max_bytes 1000000 --training.max_steps 20 \\
        --output_dir runs/code_lm_small
    python examples/finetune_exported.py --model.pretrained runs/code_lm_small/model --output_dir runs/code_lm_small_finetune

Every memtrain setting can be given as on the command line; rerunning the same command resumes.
"""

import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # memtrain from this clone

import memtrain  # noqa: E402

SEQ_LEN = 64


def package_text(names: list[str]) -> list[str]:
    """The source files of standard-library packages, one string each."""
    library = os.path.dirname(os.__file__)
    return [open(path, encoding="utf-8").read() for name in names
            for path in sorted(glob.glob(os.path.join(library, name, "*.py")))]


def token_samples(texts: list[str], tokenizer):
    """A ``datasets.Dataset`` of ``input_ids`` and ``labels`` (the next tokens), SEQ_LEN each."""
    import datasets

    # packed into SEQ_LEN samples below: a text longer than the model's positions is no error here
    stream = [i for text in texts for i in tokenizer(text, verbose=False)["input_ids"] + [tokenizer.eos_token_id]]
    starts = range(0, len(stream) - SEQ_LEN - 1, SEQ_LEN)
    return datasets.Dataset.from_dict({"input_ids": [stream[s:s + SEQ_LEN] for s in starts],
                                       "labels": [stream[s + 1:s + SEQ_LEN + 1] for s in starts]})


DEFAULTS = {
    "output_dir": "runs/code_lm_small_finetune",
    "precision": "fp32",
    "data": {"seq_len": SEQ_LEN},
    "training": {"global_batch_size": 16, "micro_batch_size": 8, "max_steps": 30, "lr": 1e-3, "warmup_steps": 3,
                 "eval_every": 10, "eval_samples": 32, "log_every": 5},
    "checkpoint": {"every_steps": 10},
}

if __name__ == "__main__":
    pretrained = next((a.split("=", 1)[1] if "=" in a else sys.argv[i + 2] for i, a in enumerate(sys.argv[1:])
                       if a.split("=", 1)[0] == "--model.pretrained"), None)
    if pretrained is None:
        sys.exit("usage: python examples/finetune_exported.py --model.pretrained EXPORTED_MODEL_DIR [--section.key value ...]")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pretrained)
    split = token_samples(package_text(["json", "email"]), tokenizer).train_test_split(test_size=0.1, seed=0)
    trainer = memtrain.Trainer(DEFAULTS, train_dataset=split["train"], eval_dataset=split["test"], tokenizer=tokenizer,
                               args=sys.argv[1:])
    result = trainer.fit()
    first, last = result.summary["initial_val_loss"], result.summary["final_val_loss"]
    if int(os.environ.get("RANK", "0")) == 0 and first is not None and last is not None:
        print(f"validation loss {first:.3f} -> {last:.3f} per token; model in {trainer.config.output_dir}/model")
