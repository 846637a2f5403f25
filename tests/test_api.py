"""memtrain from Python (:class:`memtrain.Trainer`): a user's own ``nn.Module``, data, collate
function and objective (``examples/train_module.py``) under DDP and ZeRO-3 (the model built
partitioned from the user's function) on 2 CPU ranks, killed and resumed bitwise, an injected
OOM recovered; the API and the command line giving the same losses for the same run; bad
inputs refused by name before anything is written."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ENGINES, REPO, STEPS, TINY_ARGS, launch, read_metrics, tiny_args

EXAMPLE = str(REPO / "examples" / "train_module.py")
SHORT = ["--training.max_steps", str(STEPS), "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "3",
         "--training.eval_every", "0", "--training.log_every", "1"]
EXACT = ("loss", "lr", "grad_norm", "batch_fingerprint")


def steps_of(out) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out) if "loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_example_killed_resumed_bitwise_and_recovers_from_oom(tmp_path, engine):
    """The example's run, killed after step 7, resumed from its step-2 checkpoint (the later ones
    removed), trains steps 3-7 bitwise as before; its own objective's unit is in the metrics and
    its loss falls. DDP also: an OOM injected at micro-batch 16 (halved to 8) keeps every loss
    within 1e-5 of the run without it."""
    out = tmp_path / "run"
    args = ["--output_dir", str(out), *SHORT, *ENGINES[engine], "--faults.kill_at_step", "7"]
    killed = launch(args, script=EXAMPLE, check=False, timeout=240)
    assert killed.returncode != 0
    before = steps_of(out)
    assert sorted(before) == list(range(1, 8))
    assert "positions_per_s" in before[1] and before[7]["loss"] < before[1]["loss"]  # the example's own objective
    for step in (4, 6):
        shutil.rmtree(out / "checkpoints" / f"step_{step:08d}")
    launch(args, script=EXAMPLE, timeout=240)  # resumes from step 2; the kill fired already
    after = steps_of(out)
    assert sorted(after) == list(range(1, 9))
    for step in range(3, 8):
        assert {k: after[step][k] for k in EXACT} == {k: before[step][k] for k in EXACT}, step
    if engine != "ddp":
        return
    oom = tmp_path / "oom"  # block inputs of 16 examples × up to 31 positions; 8 × 31 stays under 300
    launch(["--output_dir", str(oom), *SHORT, *ENGINES[engine], "--faults.oom_above_tokens", "300"],
           script=EXAMPLE, timeout=240)
    recovered = steps_of(oom)
    assert recovered[1]["event"] == "oom_shrink" and recovered[1]["micro_batch_size"] == 8
    for step in range(1, 8):
        assert recovered[step]["batch_fingerprint"] == before[step]["batch_fingerprint"]
        assert recovered[step]["loss"] == pytest.approx(before[step]["loss"], rel=1e-5, abs=1e-5), step


def tiny_examples(cache_dir) -> tuple[list[dict], object]:
    """The tiny run's training samples as a user's list of examples (one dict of tensors each),
    and the corpus they came from."""
    from memtrain.config import parse_args
    from memtrain.data import build_corpus

    corpus = build_corpus(parse_args(TINY_ARGS + ["--data.cache_dir", cache_dir]).data)
    return [{k: v[0] for k, v in corpus.train.batch([i]).items()} for i in range(len(corpus.train))], corpus


def test_api_and_command_line_give_the_same_losses(tmp_path, cache_dir):
    """The tiny recipe's run from the command line (its corpus, its GPT-2 from model.config), and
    from Python with the same samples as a list of examples and the same GPT-2 built by the
    caller's function with transformers: the same losses and data fingerprints, step by step."""
    import memtrain
    from memtrain.train import main
    from transformers import AutoConfig, AutoModelForCausalLM

    steps = ["--training.max_steps", "3", "--training.eval_every", "0"]
    cli = main(tiny_args(tmp_path / "cli", cache_dir, *steps)).records
    examples, corpus = tiny_examples(cache_dir)
    sizes = dict(zip(TINY_ARGS[TINY_ARGS.index("--model.config.n_layer")::2],
                     TINY_ARGS[TINY_ARGS.index("--model.config.n_layer") + 1::2]))

    def gpt2():
        config = AutoConfig.for_model("gpt2", vocab_size=corpus.vocab_size, bos_token_id=corpus.eos_id,
                                      eos_token_id=corpus.eos_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      **{k.rsplit(".", 1)[1]: int(v) for k, v in sizes.items()})
        config.use_cache, config.pad_token_id = False, None
        return AutoModelForCausalLM.from_config(config)

    base = [a for a in tiny_args(tmp_path / "api", cache_dir, *steps, model=False)]
    api = memtrain.Trainer(model=gpt2, train_dataset=examples, args=base + ["--model.config", "{}"]).fit().records
    assert [r["batch_fingerprint"] for r in api] == [r["batch_fingerprint"] for r in cli]
    assert [r["loss"] for r in api] == [r["loss"] for r in cli]
    # a third run in the same process at another precision: Accelerate's process-wide state is the
    # run's own (it refuses to change an initialized one's mixed precision)
    bf16 = [*base, "--model.config", "{}", "--output_dir", str(tmp_path / "bf16")]
    bf16[bf16.index("--precision") + 1] = "bf16"
    again = memtrain.Trainer(model=gpt2, train_dataset=examples, args=bf16).fit()
    assert again.summary["precision"] == "bf16" and len(again.records) == 3


def test_bad_python_inputs_are_refused_by_name(tmp_path):
    """Two models or two datasets named at once, an objective that is neither contract, a
    collate function giving no tensors, a module that differs between ranks: a ConfigError
    naming the field; nothing is written."""
    import memtrain
    from memtrain.data.examples import ExampleDataset
    from memtrain.objectives import as_objective

    out = tmp_path / "run"
    with pytest.raises(memtrain.ConfigError, match="'model.config'.*given from Python too"):
        memtrain.Trainer(str(REPO / "recipes" / "code_lm_tiny.yaml"), model=torch.nn.Linear(2, 2),
                         args=["--output_dir", str(out)])
    with pytest.raises(memtrain.ConfigError, match="'data.files'.*train_dataset"):
        memtrain.Trainer({"data": {"files": ["README.md"]}}, train_dataset=[{"x": torch.zeros(2)}],
                         args=["--output_dir", str(out)])
    with pytest.raises(memtrain.ConfigError, match="'objective'"):
        as_objective(3)
    with pytest.raises(memtrain.ConfigError, match="'memory.chunked_cross_entropy'.*Python objective"):
        memtrain.Trainer(model=torch.nn.Linear(2, 2), objective=lambda m, mb: m(mb["x"]).sum(),
                         args=["--output_dir", str(out), "--memory.chunked_cross_entropy", "true"])
    with pytest.raises(memtrain.ConfigError, match="'model.config.vocab_size'"):  # the config's model, no tokenizer
        memtrain.Trainer(str(REPO / "recipes" / "code_lm_tiny.yaml"), train_dataset=[{"input_ids": torch.zeros(4)}],
                         args=["--output_dir", str(out)])
    with pytest.raises(memtrain.ConfigError, match="'train_dataset'.*tokenizer go with"):
        memtrain.Trainer(model=torch.nn.Linear(2, 2), tokenizer=object(), args=["--output_dir", str(out)])
    with pytest.raises(memtrain.ConfigError, match="'collate_fn'.*dict of tensors"):
        ExampleDataset([1, 2], collate_fn=lambda xs: xs).batch([0, 1])
    pairs = [(torch.zeros(2), torch.ones(1))] * 4  # a TensorDataset's (x, y) tuples, no collate_fn: the data's fault
    with pytest.raises(memtrain.ConfigError, match="'eval_dataset': its examples are tuple, collated into list"):
        ExampleDataset(pairs, name="eval_dataset").batch([0, 1])
    with pytest.raises(memtrain.ConfigError, match=r"'train_dataset': is a dict of columns \(x, y\)"):
        memtrain.Trainer(model=torch.nn.Linear(2, 1), objective=lambda m, mb: m(mb["x"]).sum(),
                         train_dataset={"x": torch.zeros(8, 2), "y": torch.zeros(8, 1)},
                         args=["--output_dir", str(out)]).fit()
    assert not out.exists()


def test_hf_style_labels_are_shifted_as_transformers_does(caplog):
    """A dataset of {"input_ids": c, "labels": c} (transformers' convention: the model shifts):
    memtrain's causal-LM loss on its batches equals transformers' own loss for those labels
    (GPT2LMHeadModel(labels=...) shifts inside), with a warning; labels shifted already are left
    as they are; with the caller's own objective nothing is changed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from memtrain.build import UserInputs
    from memtrain.objectives import CausalLM

    torch.manual_seed(0)
    rows = [torch.randint(0, 50, (12,)) for _ in range(16)]
    hf = UserInputs(train_dataset=[{"input_ids": c, "labels": c} for c in rows]).corpus()
    assert "labels equal its input_ids" in caplog.text
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)).eval()
    batch = hf.train.batch(range(16))
    ours = CausalLM().loss_sum(model, batch) / CausalLM().count(batch)
    ids = torch.stack(rows)
    theirs = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-5, atol=1e-6)
    caplog.clear()
    shifted = [{"input_ids": c, "labels": torch.cat([c[1:], torch.tensor([-100])])} for c in rows]
    kept = UserInputs(train_dataset=shifted).corpus()
    assert torch.equal(kept.train.batch(range(16))["labels"], batch["labels"]) and "labels equal" not in caplog.text
    own = UserInputs(train_dataset=[{"input_ids": c, "labels": c} for c in rows], objective=object()).corpus()
    assert torch.equal(own.train.batch(range(16))["labels"], ids)
    # labels shifted already whose first 8 examples are one token repeated (labels equal to the ids
    # there by coincidence): the later examples show they are shifted, and nothing is shifted again
    repeated = [{"input_ids": torch.full((12,), i), "labels": torch.cat([torch.full((11,), i), torch.tensor([-100])])}
                for i in range(8)]
    coincidence = UserInputs(train_dataset=repeated + shifted).corpus()
    assert torch.equal(coincidence.train.batch(range(8, 24))["labels"], batch["labels"]) and "labels equal" not in caplog.text
    assert not UserInputs(train_dataset=repeated).corpus().train.shift_labels  # either reading: left as given


def test_a_transformers_model_trains_without_its_kv_cache():
    """The causal-LM objective calls a transformers model whose config keeps a KV cache with
    use_cache=False (no cache is built in training, none dropped under activation checkpointing);
    a plain module's forward gets no such argument."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from memtrain.objectives import make_objective

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16))
    objective = make_objective(model, corpus=None)
    seen = []
    model.register_forward_hook(lambda m, args, kwargs, out: seen.append((kwargs.get("use_cache"), out.past_key_values)),
                                with_kwargs=True)
    ids = torch.randint(0, 50, (2, 8))
    objective.loss_sum(model, {"input_ids": ids, "labels": ids})
    assert seen == [(False, None)]
    plain = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
    assert make_objective(plain, corpus=None).forward_kwargs == {}


def test_meta_copy_and_user_objective_contract():
    """A module built beforehand is planned from a meta copy (same shapes, ties kept, nothing
    allocated, the original untouched); a plain loss function's count is the examples."""
    from memtrain.meta import meta_copy
    from memtrain.objectives import as_objective

    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
    model[1].weight = model[0].weight.__class__(torch.randn(5, 3))
    model[0].weight = model[1].weight  # tied
    copy = meta_copy(model)
    assert all(p.is_meta for p in copy.parameters()) and not any(p.is_meta for p in model.parameters())
    assert copy[0].weight is copy[1].weight and copy[1].bias.shape == (5,)
    objective = as_objective(lambda m, mb: mb["x"].sum())
    batch = {"x": torch.ones(4, 2)}
    assert float(objective.count(batch)) == 4 and objective.finish(objective.eval_sums(None, batch)) == {"loss": 2.0}


def test_a_resumed_run_with_other_examples_is_refused(tmp_path):
    """A run from Python resumes with the same examples and is refused with others (another
    value in one example): the dataset identity is what the checkpoint is compared by."""
    import memtrain

    def examples(shift: float = 0.0) -> list[dict]:
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        x[37, 2] += shift
        return [{"x": row, "y": row.sum(0, keepdim=True)} for row in x]

    def run(data, steps: int):
        settings = {"output_dir": str(tmp_path / "run"), "precision": "fp32",
                    "training": {"global_batch_size": 8, "micro_batch_size": 8, "max_steps": steps, "lr": 1e-2,
                                 "warmup_steps": 0, "eval_every": 0}, "checkpoint": {"every_steps": 1}}
        return memtrain.Trainer(settings, model=lambda: torch.nn.Linear(4, 1), train_dataset=data,
                                objective=lambda m, mb: ((m(mb["x"]) - mb["y"]) ** 2).sum()).fit()

    run(examples(), 2)
    resumed = run(examples(), 3)
    assert resumed.summary["resumed_from"] and [r["step"] for r in resumed.records] == [3]
    with pytest.raises(memtrain.ConfigError, match="'train_dataset'.*differs from what checkpoint"):
        run(examples(shift=1.0), 4)


ZERO3_LAZY_IMPORT = """
import os, sys
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from memtrain.backends import model_build_context
from memtrain.backends.spec import resolve_engine
from memtrain.config import parse_args
assert "torch._dynamo" not in sys.modules, "imported already: nothing to show"
dist.init_process_group("gloo", rank=0, world_size=1)
cfg = parse_args(["--model.config", "{}", "--backend.name", "deepspeed", "--backend.zero_stage", "3"])
with model_build_context(cfg, resolve_engine(cfg.backend, 1, 0), "fp32", 1, python_function=True):
    import torch._dynamo  # what transformers' GPT-2 modeling code imports when first used
dist.destroy_process_group()
"""


def test_a_model_function_may_import_torch_dynamo_first_under_zero3():
    """A model function whose code imports ``torch._dynamo`` for the first time (transformers'
    GPT-2 modeling module does) builds under ZeRO-3's ``zero.Init``, which replaces
    ``torch.Tensor.__new__``: in a fresh interpreter (the tests' own has imported it long ago)."""
    from conftest import _free_port

    proc = subprocess.run([sys.executable, "-c", ZERO3_LAZY_IMPORT, str(_free_port())], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_transformers_model_function_under_zero3_is_initialized_as_transformers_does(monkeypatch):
    """A model function calling transformers' ``from_config`` under ZeRO-3 gets weights initialized
    as without ZeRO (GPT-2's token embeddings: normal with transformers' ``initializer_range``
    0.02, gathered), not left as ``nn.Embedding`` made them (standard deviation 1: transformers'
    own init had written into the empty partitions; its validation loss was 40 after three
    steps, against 6.8 under DDP): transformers is told it builds under ZeRO-3."""
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import _free_port
    from memtrain.backends import model_build_context
    from memtrain.backends.spec import resolve_engine
    from memtrain.config import parse_args

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cfg = parse_args(["--model.config", "{}", "--backend.name", "deepspeed", "--backend.zero_stage", "3"])
        with model_build_context(cfg, resolve_engine(cfg.backend, 1, 0), "fp32", 1, python_function=True):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=2, n_embd=256, n_head=4,
                                                                          vocab_size=512, n_positions=64))
        weight = model.transformer.wte.weight
        assert weight.numel() == 0  # partitioned
        with deepspeed.zero.GatheredParameters([weight]):
            std = float(weight.std())
    finally:
        dist.destroy_process_group()
    assert std == pytest.approx(0.02, rel=0.1)


def test_a_model_function_is_built_partitioned_under_zero3(monkeypatch):
    """Under ZeRO-3 a Python caller's model function runs inside ``deepspeed.zero.Init``: each
    parameter leaves the build as this rank's partition (DeepSpeed's ``ds_numel`` the whole
    size, the tensor itself empty), never whole; under DDP it is built whole. The process keeps
    torch's own ``F.linear`` through the build (DeepSpeed swaps in its own for the process and never
    puts it back); the engine then runs DeepSpeed's memory-efficient linear, as it does for a model
    built whole, and its close puts torch's back."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.runtime.zero.partition_parameters import zero3_linear_wrap

    from memtrain.backends.ds_zero_init import restore_torch_linear, use_memory_efficient_linear

    from conftest import _free_port
    from memtrain.backends import model_build_context
    from memtrain.backends.spec import resolve_engine
    from memtrain.config import parse_args

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        built = {}
        for engine in (["--backend.name", "deepspeed", "--backend.zero_stage", "3"], ["--backend.name", "ddp"]):
            cfg = parse_args(["--model.config", "{}", *engine])
            spec = resolve_engine(cfg.backend, 1, 0)
            with model_build_context(cfg, spec, "fp32", 1, python_function=True):
                built[spec.name] = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        assert F.linear is torch._C._nn.linear
        use_memory_efficient_linear()  # as the engine does after deepspeed.initialize
        assert F.linear is zero3_linear_wrap
        restore_torch_linear()
        assert F.linear is torch._C._nn.linear
    finally:
        dist.destroy_process_group()
    partitioned, whole = built["deepspeed"], built["ddp"]
    assert [p.ds_numel for p in partitioned.parameters()] == [p.numel() for p in whole.parameters()]
    assert all(p.numel() == 0 and p.dtype == torch.float32 for p in partitioned.parameters())  # fp32 run: fp32
    assert not any(hasattr(p, "ds_id") for p in whole.parameters())


RANK_DATA = """
import os, sys, torch
import memtrain
rank = int(os.environ["RANK"])
examples = [{"x": torch.full((2,), float(i + (rank if i == 5 else 0)))} for i in range(16)]  # rank 1: example 5 differs
try:
    memtrain.Trainer({"output_dir": sys.argv[1], "training": {"global_batch_size": 4, "micro_batch_size": 2}},
                     model=lambda: torch.nn.Linear(2, 1), train_dataset=examples,
                     objective=lambda m, mb: m(mb["x"]).sum()).fit()
except memtrain.ConfigError as exc:
    print(f"rank {rank}: {exc}")
    sys.exit(2)
"""


@pytest.mark.slow
def test_ranks_that_built_different_examples_are_refused(tmp_path):
    """Two ranks whose datasets differ in one example: every rank stops with the ConfigError
    naming train_dataset before step 1; no step is trained."""
    script = tmp_path / "rank_data.py"
    script.write_text(RANK_DATA)
    proc = launch([str(tmp_path / "run")], script=str(script), check=False, timeout=180)
    assert proc.returncode != 0
    assert proc.stdout.count("config error in 'train_dataset': differs between ranks") == 2, proc.stdout[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


TWO_RANKS = """
import json, os, sys, time, torch
import memtrain
rank = int(os.environ["RANK"])
examples = [{"x": torch.full((2,), float(i))} for i in range(64)]
try:
    result = memtrain.Trainer({"output_dir": sys.argv[1], "training": {"global_batch_size": 4, "micro_batch_size": 2,
                                                                       "max_steps": 6, "eval_every": 0}},
                              model=lambda: torch.nn.Linear(2, 1), train_dataset=examples, args=sys.argv[2:],
                              objective=lambda m, mb: m(mb["x"]).sum()).fit()
except memtrain.CollectiveError as exc:
    print(f"CollectiveError on rank {rank}: {exc}", flush=True)
    sys.exit(6)
with open(os.path.join(sys.argv[1], f"summary_rank{rank}.json"), "w") as fh:
    json.dump(result.summary, fh)
"""


@pytest.mark.slow
def test_python_api_ranks_share_one_summary_and_a_dead_peer_is_one_line(tmp_path):
    """Two ranks from Python: result.summary is the same object on both (rank 0's, which wrote
    summary.json). Rank 1 killed after step 3: rank 0's fit raises memtrain.CollectiveError whose
    one-line message names the rank, the operation and backend.timeout_s (not gloo's trace). The
    launcher looks at its ranks every 2 s (torchrun's ``--monitor-interval``): at its default 0.1 s
    it stops rank 0 (SIGTERM) as soon as it sees rank 1 dead, before a rank 0 slowed by the
    suite's other worker reaches its next collective (CI, twice)."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    launch([str(tmp_path / "run")], script=str(script), timeout=180)
    summaries = [json.loads((tmp_path / "run" / f"summary_rank{r}.json").read_text()) for r in (0, 1)]
    assert summaries[0] == summaries[1] == json.loads((tmp_path / "run" / "summary.json").read_text())
    proc = launch([str(tmp_path / "dead"), "--faults.kill_at_step", "3", "--faults.kill_ranks", "[1]",
                   "--backend.timeout_s", "30"], script=str(script), check=False, timeout=180,
                  monitor_interval_s=2.0)
    said = [line for line in proc.stdout.splitlines() if line.startswith("CollectiveError on rank 0: ")]
    assert len(said) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0: a collective failed during" in said[0] and "backend.timeout_s 30" in said[0]
