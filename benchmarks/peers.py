"""memtrain beside the trainers a user would pick instead, on the same model, data and schedule.

Each trainer runs a script a user would write (``benchmarks/peer_scripts/``): transformers'
``Trainer`` (DDP; its DeepSpeed ZeRO-2/3 integration with ``--engines``), a plain Accelerate loop,
PyTorch Lightning (where ``pytorch-lightning`` is installed: the ``bench`` extra) and
``memtrain.Trainer``. All start from the same weights (one transformers config, one seed), take
the same settings (:data:`SETTINGS`, printed into every row: global batch, micro-batch, AdamW's
every hyperparameter, warmup + cosine schedule to the same floor, gradient clipping, fp32, the
same steps) and the same global batches in the same order (memtrain's sampler draws them from
memtrain's corpus of the standard library for a ``data_seed``; the others read them in that
order, unshuffled: ``peer_scripts/shared.py``), on 2 CPU ranks (gloo, torchrun). Each repeat
draws another data seed and runs every trainer once, in turn (the machine's load drifts). One
JSON row per trainer, engine and repeat:

    trainer, engine, repeat, data_seed, tokens_per_s (global batch × tokens per sample ÷ the
    median optimizer step after the first two, the trainer's own step ends: a callback, the loop,
    memtrain's records), tokens_per_cpu_s (the tokens of the steps after the first two ÷ the CPU
    seconds of both ranks' processes over those steps: what the load of other processes cannot
    shorten or stretch much), peak_bytes (the largest ``ru_maxrss`` of the ranks: resident memory,
    the same counter for every trainer), imports_bytes (the largest rank's resident peak once its
    libraries are imported, before any model or data), above_imports_bytes (the largest of the
    ranks' peaks minus their import footprints), model_state_bytes (16 bytes a parameter: fp32
    weights, gradients and AdamW's moments, the same for every trainer on DDP), val_loss (the saved model's mean next-token loss on the
    same validation rows, computed here by one function for all), ran (what the trainer's script
    says it ran, where it can: transformers' Trainer its Accelerate distributed type and the
    modules FSDP sharded; a run asked for FSDP that sharded nothing is a failed row), user_lines (the trainer's
    script, without blank lines, comments and docstrings); a run that fails is a row with
    ``failed``: the exception that stopped it (:func:`failure_cause`), what a user of that trainer
    would meet


a ``summary`` row per trainer and engine: min / median / max of each over the repeats; and a
``paired`` row per peer and engine: memtrain's tokens_per_cpu_s and tokens_per_s ÷ the peer's in
the same repeat, min / median / max over repeats.

    python benchmarks/peers.py                      # DDP: 3 trainers × 3 repeats, 30 steps
    python benchmarks/peers.py --engines ddp,fsdp,zero2,zero3  # every engine each trainer offers
    python benchmarks/peers.py --quick              # 3 steps, 1 repeat (the tests)
    python benchmarks/peers.py --results            # also append the rows to benchmarks/results/

Each trainer is run on every engine it offers (:data:`ENGINES_OF`), on CPU ranks whether or not it
supports them there: Lightning's FSDP and DeepSpeed strategies and transformers' ZeRO-3 stop on CPU
ranks, and their rows say why; transformers' FSDP on CPU ranks trains DDP without a word
(Accelerate's ``MULTI_CPU``, no module sharded), and its row says so as a failure. Not here yet: what each trainer does when memory runs out under
one budget.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import json
import os
import re
import shutil
import statistics
import sys
import tokenize
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RunFailed, emit, run_memtrain, scratch_dir, spread  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "peer_scripts"
sys.path.insert(0, str(SCRIPTS))
from shared import build_model  # noqa: E402

TRAINERS = {"memtrain": "memtrain_trainer.py", "hf_trainer": "hf_trainer.py", "accelerate": "accelerate_loop.py",
            "lightning": "lightning_module.py", "memtrain_glibc": "memtrain_trainer.py",
            "memtrain_fast": "memtrain_trainer.py"}
"""trainer → its script in ``benchmarks/peer_scripts/``. Not run by default, memtrain with its
CPU run's malloc thresholds changed (memtrain/host_allocator.py: a CPU run fixes them at 128 KiB
so that the host bytes it plans hold): ``memtrain_glibc``, ``memory.host_allocator_thresholds
false``, glibc's thresholds left to move as they do in the peers' processes; ``memtrain_fast``,
``true``, fixed at 32 / 64 MiB, a GPU run's setting (freed blocks kept for the next micro-batch)."""
VARIANTS = ("memtrain_glibc", "memtrain_fast")
INSTALLED = tuple(t for t in TRAINERS if t not in VARIANTS
                  and (t != "lightning" or importlib.util.find_spec("pytorch_lightning")))
"""The trainers run by default: Lightning where ``pytorch-lightning`` is installed (the ``bench`` extra)."""
ENGINES_OF = {"memtrain": ("ddp", "fsdp", "zero2", "zero3"), "hf_trainer": ("ddp", "fsdp", "zero2", "zero3"),
              "accelerate": ("ddp",), "lightning": ("ddp", "fsdp", "zero2", "zero3"), **{v: ("ddp", "fsdp", "zero2", "zero3") for v in VARIANTS}}
"""The engines each trainer offers. On CPU ranks transformers' ZeRO-3 stops (its DeepSpeed config is
resolved before the process group, so DeepSpeed asserts a train batch of micro-batch × accumulation
× 1 rank: transformers 5.24, DeepSpeed 0.19.8), its FSDP trains DDP (nothing sharded), and
Lightning's FSDP and DeepSpeed strategies ask for a GPU (pytorch-lightning 2.6); their rows are
failures that say so."""
MODEL = {"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4, "n_positions": 64, "resid_pdrop": 0.0,
         "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
"""The benchmarks' CPU model (``common.CPU_ARGS``: 0.27M parameters with the 1024-token vocabulary)."""
SETTINGS = {"seed": 1234, "global_batch_size": 16, "micro_batch_size": 4, "lr": 3e-3, "warmup_steps": 2,
            "min_lr_ratio": 0.1, "weight_decay": 0.1, "max_grad_norm": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.95,
            "adam_eps": 1e-8, "precision": "fp32", "schedule": "warmup from 0, cosine to min_lr_ratio",
            "decay": "matrices only", "threads_per_rank": "torch's default"}
"""What every trainer is given (global batch 16 on 2 ranks: micro-batch 4, accumulation 2); AdamW's
betas and epsilon too (memtrain's defaults; transformers' and torch's are 0.999 for beta2). Each
script reads its numbers from here; the words say what each script does alike."""
FIRST_DATA_SEED = 1
"""Repeat ``r`` draws its global batches with data seed ``FIRST_DATA_SEED + r``."""
VOCAB, SEQ_LEN, VALIDATION_ROWS = 1024, 64, 64


def write_data(folder: str, steps: int, cache_dir: str | None, data_seed: int = FIRST_DATA_SEED, vocab: int = VOCAB,
               seq_len: int = SEQ_LEN, global_batch_size: int = SETTINGS["global_batch_size"]) -> str:
    """The rows every trainer reads: memtrain's corpus (the standard library, the benchmarks'
    1 MB slice and a ``vocab``-token tokenizer), ``steps`` global batches of training rows
    (``train``; ``train_in_order``: the same rows as memtrain's sampler orders them for
    ``data_seed``, global batch after global batch) and :data:`VALIDATION_ROWS` validation rows,
    int32 [N, ``seq_len``] in ``folder/data-<data_seed>.npz``."""
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.data.sampler import Cursor, GlobalBatchSampler

    cfg = parse_args(["--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), "--data.max_bytes", "1000000",
                      "--data.vocab_size", str(vocab), "--data.seq_len", str(seq_len)]
                     + (["--data.cache_dir", cache_dir] if cache_dir else []))
    corpus = build_corpus(cfg.data)
    n = global_batch_size * steps
    if n > len(corpus.train):
        raise SystemExit(f"--steps {steps}: {n} rows wanted, the corpus has {len(corpus.train)}")
    path = os.path.join(folder, f"data-{data_seed}.npz")
    train = corpus.train.batch(np.arange(n))["input_ids"].numpy().astype(np.int32)
    sampler = GlobalBatchSampler(n, global_batch_size, data_seed)
    order = np.concatenate([sampler.global_batch(Cursor(0, step)) for step in range(steps)])
    np.savez(path, train=train, train_in_order=train[order],
             validation=corpus.validation.batch(np.arange(VALIDATION_ROWS))["input_ids"].numpy().astype(np.int32))
    return path


def user_lines(script: Path) -> int:
    """Lines of code in ``script``: no blank lines, comments or docstrings."""
    source = script.read_text()
    docstrings = {node.body[0].lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    code = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                tokenize.ENDMARKER)}
    return len(code - docstrings)


def val_loss(model_dir, data: str) -> float:
    """Mean next-token cross-entropy of the model saved in ``model_dir`` (or a model) on the
    validation rows (one function for every trainer's model)."""
    from transformers import AutoModelForCausalLM

    model = (AutoModelForCausalLM.from_pretrained(model_dir) if isinstance(model_dir, str) else model_dir).eval()
    rows = torch.from_numpy(np.load(data)["validation"].astype(np.int64))
    with torch.no_grad():
        return float(model(input_ids=rows, labels=rows).loss)


def initial_val_loss(settings: dict) -> float:
    """:func:`val_loss` of the model every trainer starts from (``peer_scripts/shared.build_model``)."""
    return val_loss(build_model(settings), settings["data"])


def deepspeed_configs(folder: str) -> dict[str, str]:
    """transformers' DeepSpeed JSONs for ZeRO-2/3 ("auto" everywhere transformers fills it in)."""
    paths = {}
    for stage in (2, 3):
        paths[f"deepspeed_zero{stage}"] = path = os.path.join(folder, f"zero{stage}.json")
        with open(path, "w") as fh:
            json.dump({"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
                       "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                       "train_batch_size": "auto", "optimizer": {"type": "AdamW", "params": {
                           "lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"}}}, fh)
    return paths


def run_peer(trainer: str, engine: str, settings: dict, folder: str, timeout: float) -> dict:
    """One run of ``trainer`` on ``engine`` (2 ranks): its row (see the module docstring)."""
    out = os.path.join(folder, f"{trainer}-{engine}")
    shutil.rmtree(out, ignore_errors=True)
    path = os.path.join(folder, f"settings-{trainer}-{engine}.json")
    with open(path, "w") as fh:
        json.dump({**settings, "out": out}, fh)
    env = {"PEERS_SETTINGS": path, "PEERS_ENGINE": engine, "PEERS_TRAINER": trainer,
           "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    script = str(SCRIPTS / TRAINERS[trainer])
    row = {"benchmark": "peers", "trainer": trainer, "engine": engine, "user_lines": user_lines(SCRIPTS / TRAINERS[trainer])}
    try:
        run_memtrain([], out, nproc=2, timeout=timeout, env=env, script=script, metrics=False)
    except RunFailed as failed:  # a row that says so: what a user of that trainer would meet
        return {**row, "failed": failure_cause(failed.stderr)}
    records = [json.load(open(os.path.join(out, f"record_{rank}.json"))) for rank in range(2)]
    ran = records[0].get("ran") or {}
    if engine == "fsdp" and ran.get("sharded_units") == 0:  # asked for FSDP, trained without it: not an FSDP row
        return {**row, "ran": ran, "failed": f"trained without sharding ({ran.get('distributed_type')}, no FSDP "
                "unit): asked for FSDP on CPU ranks, the trainer ran DDP and said nothing"}
    ends = records[0]["step_end_s"]
    steps = [b - a for a, b in zip(ends, ends[1:])][1:]  # after the first two steps
    tokens = settings["global_batch_size"] * SEQ_LEN
    cpu = sum(r["step_end_cpu_s"][-1] - r["step_end_cpu_s"][1] for r in records) if len(ends) > 2 else 0.0
    return {**row, "data_seed": settings["data_seed"], "steps": len(ends),
            "tokens_per_s": tokens / statistics.median(steps) if steps else None,
            "tokens_per_cpu_s": tokens * (len(ends) - 2) / cpu if cpu > 0 else None,
            "peak_bytes": max(r["peak_rss_bytes"] for r in records), "peak_counter": "ru_maxrss",
            # the memory column broken down: each rank's import footprint, the model state every
            # trainer holds alike (fp32 weights, gradients, AdamW's two moments), and the rest
            "imports_bytes": max(r["imports_rss_bytes"] for r in records),
            "above_imports_bytes": max(r["peak_rss_bytes"] - r["imports_rss_bytes"] for r in records),
            "model_state_bytes": 16 * settings["parameters"],
            "val_loss": val_loss(os.path.join(out, "model"), settings["data"]), "ran": ran or None,
            "initial_val_loss": settings["initial_val_loss"]}


def failure_cause(stderr: str) -> str:
    """What stopped a failed run: the last exception a rank raised (``SomeError: message``, the
    torchrun summary after it left out), else the tail of its standard error."""
    causes = [line.strip() for line in stderr.splitlines()
              if re.match(r"^\s*(\[rank\d+\]:\s*)?[A-Za-z_.]*(Error|Exception)\b", line)
              and "ChildFailedError" not in line and "elastic" not in line]
    return causes[-1][:600] if causes else stderr[-600:]


def summary(rows: list[dict]) -> list[dict]:
    """min / median / max of tokens/s, peak bytes and validation loss per trainer and engine."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["trainer"], r["engine"]), []).append(r)

    def measured(values):  # the repeats that measured it; None when none did
        values = [v for v in values if v is not None]
        return spread(values) if values else None

    return [{"benchmark": "peers", "summary": True, "trainer": t, "engine": e, "repeats": len(g),
             "failed": sum("failed" in r for r in g),
             **{k: measured([r.get(k) for r in g]) for k in ("tokens_per_s", "tokens_per_cpu_s", "peak_bytes", "val_loss",
                                                             "imports_bytes", "above_imports_bytes")},
             "model_state_bytes": g[0].get("model_state_bytes"),
             "user_lines": g[0]["user_lines"]} for (t, e), g in groups.items()]


def paired(rows: list[dict]) -> list[dict]:
    """Each memtrain (memtrain and its :data:`VARIANTS`) ÷ each other trainer, and memtrain ÷ each
    variant, per engine, within each repeat (the same data seed, run one after the other): min /
    median / max over repeats of tokens_per_cpu_s and tokens_per_s (``trainer`` the divisor,
    ``numerator`` the memtrain divided)."""
    by = {(r["trainer"], r["engine"], r["repeat"]): r for r in rows if "failed" not in r and "repeat" in r}
    ours = ("memtrain", *VARIANTS)
    out = []
    for numerator in ours:
        for (trainer, engine) in sorted({(t, e) for t, e, _ in by if t not in ours or
                                         (numerator == "memtrain" and t != numerator)}):
            pairs = [(by[(numerator, engine, rep)], by[(trainer, engine, rep)]) for t, e, rep in by
                     if (t, e) == (trainer, engine) and (numerator, engine, rep) in by]
            if not pairs:
                continue
            ratios = {k: [m[k] / p[k] for m, p in pairs if m.get(k) and p.get(k)]
                      for k in ("tokens_per_cpu_s", "tokens_per_s")}
            out.append({"benchmark": "peers", "paired": True, "numerator": numerator, "trainer": trainer,
                        "engine": engine, "pairs": len(pairs),
                        **{f"memtrain_over_peer_{k}": spread(v) if v else None for k, v in ratios.items()}})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 repeat (prints only)")
    parser.add_argument("--trainers", default=",".join(INSTALLED), help="comma-separated subset of " + ",".join(TRAINERS))
    parser.add_argument("--engines", default="ddp", help="comma-separated: ddp, fsdp, zero2, zero3 (where the trainer has it)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats, each with its own data seed")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--results", action="store_true", help="append to benchmarks/results/ (not with --quick)")
    parser.add_argument("--data_cache_dir", default=None, help="a corpus cache to reuse (data.cache_dir)")
    opts = parser.parse_args(argv)
    steps, repeats = (3, 1) if opts.quick else (opts.steps, opts.repeats)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    folder = scratch_dir("peers")
    try:
        base = {**SETTINGS, "model": {**MODEL, "vocab_size": VOCAB}, "max_steps": steps, **deepspeed_configs(folder)}
        base["parameters"] = sum(p.numel() for p in build_model({**base, "seed": 0}).parameters())
        runs = [(t, e) for e in opts.engines.split(",") for t in opts.trainers.split(",") if e in ENGINES_OF[t]]
        rows = []
        for repeat in range(repeats):
            seed = FIRST_DATA_SEED + repeat
            settings = {**base, "data_seed": seed, "data": write_data(folder, steps, opts.data_cache_dir, seed)}
            settings["initial_val_loss"] = initial_val_loss(settings)
            for trainer, engine in runs:
                row = {**run_peer(trainer, engine, settings, folder, timeout=1800), "repeat": repeat,
                       "settings": SETTINGS}  # the same for every trainer, printed into its row
                rows.append(row)
                emit("peers", "cpu", row, save=opts.results and not opts.quick)
        for row in summary(rows) + paired(rows):
            emit("peers", "cpu", row, save=opts.results and not opts.quick)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
