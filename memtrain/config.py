"""Run configuration: one dataclass per section, YAML recipes, ``--section.key value`` overrides.

Parsing (types, unknown keys, choices) is done by jsonargparse; :func:`memtrain.validation.validate`
adds the checks that need several fields at once (batch divisibility, sequence length against
the model's positions, data files that exist). Every error names the field and what is allowed,
and is raised before anything is written to ``output_dir``.

The command line: ``python memtrain/train.py --config recipes/code_lm_tiny.yaml
--output_dir DIR --training.max_steps 50``; any key overridable as ``--section.key value``.
The DeepSpeed launcher's ``--local_rank N`` and ``--deepspeed FILE`` are accepted too.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from memtrain.argv import join_negative_numbers, strip_launcher_args
from memtrain.cli_help import describe
from memtrain.engine_names import ENGINE_CHOICES
from memtrain.errors import ConfigError  # raised here; the rest of memtrain imports it from here too
from memtrain.recipe import check_recipe, explain_parse_error, not_a_section


class FrozenConfigError(AttributeError):
    """A validated config was written to: resolved values live in the engine spec and the plan."""


@dataclass
class SpeechDataConfig:
    """The embedded synthetic speech corpus (``data.kind: speech`` without ``data.files``):
    eSpeak NG reading sentences of the standard library's docstrings and comments."""

    train_utterances: int = 2000
    """Training utterances to synthesise."""
    test_utterances: int = 200
    """Test utterances (sentences from held-out source files) to synthesise."""
    min_words: int = 3
    """Shortest sentence kept, in words."""
    max_words: int = 12
    """Longest sentence kept, in words."""
    seed: int = 1234
    """Voice, rate, pitch and synthesis noise of utterance i are a pure function of (seed, i)."""
    bucket_batches: int = 8
    """Length-aware batching: each epoch's permutation is cut into buckets of this many global
    batches, each sorted by length, so a global batch holds utterances of similar length (less
    padding); the batches' order is then shuffled. 0 = off."""
    max_audio_samples_per_micro_batch: int = 0
    """Cap a step's micro-batch so that micro_batch_size × its longest utterance, in 16 kHz audio
    samples (padding included), stays within this; 0 = no cap (fairseq's max_tokens)."""
    max_frames_per_micro_batch: Optional[int] = None
    """Deprecated name of ``max_audio_samples_per_micro_batch`` (it counts audio samples, not frames)."""


@dataclass
class DataConfig:
    """Where the training data comes from and how it is tokenised and packed."""

    kind: Literal["text", "speech"] = "text"
    """text: a causal language model on packed tokens; speech: CTC speech recognition on
    utterances (``data.speech``)."""
    files: Optional[list[str]] = None
    """Text (.txt, .py, …) or JSONL files, or glob patterns; HuggingFace ``datasets`` on disk
    (``save_to_disk`` folders, local .parquet/.arrow files: each row's ``text_field`` is one
    document, a dataset dict's validation/test split is the validation split). None = the Python
    standard library source of the running interpreter (the embedded default corpus). With ``kind: speech``: JSONL
    manifests of ``{"audio": path, "text": ...}`` (WAV/FLAC/…, read by soundfile); None = the
    synthetic corpus."""
    encoding: str = "utf-8"
    """The text encoding of ``data.files`` (text and JSONL), any Python codec (latin-1, cp1252,
    utf-16, …). Bytes that do not decode are read as U+FFFD, counted and reported per file; above
    0.1% of a file's bytes the run stops (exit 2) naming the file."""
    text_field: str = "text"
    """Field (JSONL) or column (``datasets`` sources) holding the document text."""
    max_bytes: int = 0
    """Use at most this many bytes of source text (files in sorted order); 0 = all."""
    validation_fraction: float = 0.05
    """Fraction of the text files' bytes (or a ``datasets`` source's rows) held out for validation.
    Text files are held out whole, in the order of a hash of their paths (deterministic), while the
    held-out bytes stay within the fraction (a few large files: the smallest, with a warning when it
    is more); rows of a ``datasets`` source without a validation split, by a hash of their index."""
    vocab_size: int = 8192
    """Size of the byte-level BPE vocabulary trained on the training split. The model's vocabulary
    is the tokenizer's real size, which differs (with a warning) when the corpus gives fewer merges,
    or when this is below the byte alphabet plus special tokens."""
    seq_len: int = 256
    """Tokens per packed training sample."""
    cache_dir: Optional[str] = None
    """Where the tokenizer and token streams are cached (keyed by a hash of the inputs).
    None = $MEMTRAIN_CACHE or ~/.cache/memtrain."""
    speech: SpeechDataConfig = field(default_factory=SpeechDataConfig)
    """Speech corpus settings (``kind: speech``)."""


@dataclass
class ModelConfig:
    """The model: a transformers config, or a factory for a plain ``nn.Module``."""

    config: dict = field(default_factory=dict)
    """transformers config keys with ``model_type`` (e.g. gpt2, llama). ``vocab_size`` defaults
    to the tokenizer's. With ``factory``, these are passed to it as keyword arguments."""
    factory: Optional[str] = None
    """``package.module:function`` returning an ``nn.Module`` mapping input_ids [B, T] (int64)
    to logits [B, T, V]; called as ``function(vocab_size=V, **config)``."""
    pretrained: Optional[str] = None
    """A local ``from_pretrained`` folder (``memtrain export``'s output, or any transformers
    checkpoint on disk; nothing is downloaded): its config and weights start the run, and its
    tokenizer, when it has one, replaces the BPE trained on ``data.files``. ``model.config`` then
    holds overrides of its config (e.g. dropout); keys that change a weight's shape are refused."""
    # LoRA (peft, the lora extra; docs/configuration.md): only the adapters train, the base is
    # frozen in its dtype; the update is scaled by lora_alpha / lora_rank; dropout on the adapters' input
    lora_rank: int = 0
    """LoRA rank; 0 = off."""
    lora_alpha: float = 16.0
    """LoRA's alpha."""
    lora_dropout: float = 0.0
    """LoRA's dropout."""
    lora_target_modules: Optional[list[str]] = None
    """Modules given LoRA adapters; null = peft's default."""


@dataclass
class TrainingConfig:
    """Optimisation: batch geometry, schedule, evaluation."""

    global_batch_size: int = 32
    """Samples per optimizer step, summed over all ranks and micro-batches."""
    micro_batch_size: Union[int, Literal["auto"]] = 8
    """Samples per forward/backward on one rank. auto = the planner's fastest plan predicted to fit
    the device (memtrain/planning/planner.py): every divisor of the rank's share, with each setting
    of the levers memory.activation_checkpointing and memory.levers allow, timed before step 1."""
    max_steps: int = 100
    """Optimizer steps to run."""
    seed: int = 1234
    """Seed for model init and the data order."""
    lr: float = 1e-3
    """Peak learning rate (after warmup)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio at max_steps."""
    warmup_steps: int = 10
    """Linear warmup length, in optimizer steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to biases and norm weights)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    """AdamW's epsilon (added to the square root of the second moment)."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold (global L2 norm); 0 disables clipping."""
    eval_every: int = 50
    """Evaluate on the validation split every this many optimizer steps (0 = only at the end)."""
    eval_samples: int = 64
    """Validation samples per evaluation (the first ones of the validation split)."""
    log_every: int = 1
    """Progress-bar refresh period in steps (metrics.jsonl always gets every step)."""
    compile: bool = False
    """``torch.compile`` each repeated block (regional compilation: after the model is built,
    before the engine wraps it; memtrain/transforms.py). The first step, and the first micro-batch
    of a new size, pay the compile time."""
    gc_every_steps: int = 50
    """Python's cyclic garbage collector runs after every this many optimizer steps, on every rank
    at once, instead of automatically in the middle of steps (memtrain/collector.py); 0 = Python's
    automatic collector."""
    max_nonfinite_steps: int = 10
    """A non-finite loss or gradient norm skips that optimizer step on every rank; after this
    many consecutive skips the run stops (the last good checkpoint is left as it was)."""


@dataclass
class OptimizerConfig:
    """How AdamW keeps its state (its hyperparameters are ``training.*``)."""

    state_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """AdamW's two moments: fp32 = 8 bytes per parameter; bf16 = 4 (stepped in fp32, stored
    rounded to nearest); int8 = about 2 (torchao's 8-bit AdamW, block-wise scaled; the extra
    memtrain[lowbit]; DDP and FSDP2 only). bf16 and int8 are lossy: the moments are rounded every
    step. Must match on resume."""


@dataclass
class BackendConfig:
    """The distributed engine."""

    name: Literal[ENGINE_CHOICES] = "auto"
    """auto = inferred from the launcher (accelerate's FSDP/DeepSpeed environment, or the DeepSpeed
    launcher's --deepspeed FILE), else ddp. ddp also covers a single process."""
    zero_stage: Optional[Literal[1, 2, 3]] = None
    """DeepSpeed ZeRO stage: 1 = shard optimizer state, 2 = + gradients, 3 = + parameters.
    None = the DeepSpeed JSON's stage, else 2."""
    offload: Optional[Literal["none", "optimizer", "optimizer_and_params", "auto"]] = None
    """Move optimizer state (and parameters) to host memory: DeepSpeed ZeRO offload; under FSDP2
    ``optimizer`` is memtrain's optimizer offload (parameters and gradients stay sharded on the
    device in the compute dtype, the fp32 master weights and Adam moments move, stepped on the CPU
    beside the next forward: memtrain/backends/optimizer_offload.py) and ``optimizer_and_params`` torch's
    CPUOffloadPolicy (everything on the host). auto = the placement
    planner chooses ZeRO stage, what is offloaded and ``offload_optimizer_ratio`` for this model,
    the device memory and ``memory.host_memory_gib`` (memtrain/planning/placement.py; DeepSpeed, or FSDP2
    offload on or off). None = the DeepSpeed JSON's offload, else none."""
    offload_optimizer_ratio: float = 1.0
    """With ``offload optimizer`` (DeepSpeed ZeRO-3 or FSDP2): the fraction of the optimizer state
    (fp32 master weights and Adam moments) kept on the host and stepped there; the rest stays on
    the device and is stepped there (DeepSpeed's partial offload, ``offload_optimizer.ratio``;
    FSDP2: the last parameters of the model). 1.0 = all on the host."""
    host_step_overlap: Optional[bool] = None
    """FSDP2 with ``offload optimizer``: the host part's CPU step runs on while the next forward
    starts (each block waits for its own parameters); false = the step waits for it. null = on
    with a GPU, off on a CPU device, whose forward would compete with the CPU step for the same
    cores (2 CPU ranks on 2 cores: 1.3x slower overlapped, benchmarks/offload_overlap.py)."""
    nvme_path: Optional[str] = None
    """DeepSpeed ZeRO-3: offload to NVMe files in this folder instead of host memory (optimizer
    state, and the parameters under ``optimizer_and_params``; not with a partial
    ``offload_optimizer_ratio``). Needs DeepSpeed's async_io op (libaio)."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (ZeRO-3 style, less memory) instead of
    keeping them until backward (ZeRO-2 style, less communication)."""
    deepspeed_config: Optional[str] = None
    """A DeepSpeed JSON config (the launcher's --deepspeed FILE sets it). Its "auto" values are
    filled from this config; a value that contradicts this config is an error."""
    find_unused_parameters: Literal["auto", "true", "false"] = "auto"
    """DDP: auto = on when the model skips layers at random (layerdrop > 0). A parameter that
    received no gradient on the first step is otherwise named after it: in a warning with OOM
    recovery on (its gradient is reduced as zeros), in an error with it off."""
    timeout_s: float = 600.0
    """The longest any collective, or any one operation of the loop (a micro-batch's forward and
    backward, an optimizer step, an evaluation batch, a checkpoint save or load), may take, in
    seconds. Past it the rank ends with exit code 6 and a message naming the rank and the
    operation, so a rank that hangs or dies never leaves the others waiting for ever (the process
    group's timeout, NCCL's async error handling on CUDA, and memtrain's watchdog thread)."""


@dataclass
class MemoryConfig:
    """Out-of-memory recovery and memory levers (docs/design.md, "The OOM protocol")."""

    oom_recovery: bool = True
    """On out-of-memory, all ranks agree, halve micro_batch_size, double accumulation and retry
    the same samples. Also defers DDP's gradient all-reduce until every rank finished its
    micro-batches, so an OOM on one rank never leaves another waiting in a collective."""
    # generated from the levers' declarations (memtrain/levers/): python -m memtrain.levers rewrites them
    levers: Literal["off", "auto"] = "off"
    """auto = the planner (training.micro_batch_size auto) and out-of-memory recovery also choose
    among the lossless levers left at their defaults: activation checkpointing off, selective or on
    (when memory.activation_checkpointing is auto), chunked cross-entropy (a config's language
    model, when memory.chunked_cross_entropy is false) and activation offload (when
    memory.activation_offload is auto); off = only the micro-batch and activation checkpointing
    off/on, as configured."""
    activation_checkpointing: Literal["off", "on", "selective", "auto"] = "auto"
    """Recompute block activations in backward: on = all of each block's; selective = keep the
    matmul and attention outputs, recompute pointwise ops and norms (same losses as off, less than
    half of off's activation memory on GPT-2); auto = off until an OOM at micro-batch 1 asks for
    on."""
    activation_checkpointing_every_n_blocks: int = 1
    """With activation checkpointing on: recompute every n-th block (1 = all; 2 = half the blocks,
    less recompute, more memory)."""
    checkpoint_every: Optional[int] = None
    """Deprecated name of ``activation_checkpointing_every_n_blocks``."""
    chunked_cross_entropy: bool = False
    """Language models: the output layer computes the cross-entropy a chunk of tokens at a time,
    recomputing each chunk's logits in backward, so the [tokens, vocab] logits are never held
    (memtrain/levers/chunked_cross_entropy.py; gpt2, llama, mistral, qwen2, qwen3). Saves vocab × 4
    bytes per token of activations for one more output-layer matmul per token."""
    activation_offload: Literal["off", "on", "auto"] = "auto"
    """Saved activations wait for backward in host memory. Lossless
    (memtrain/levers/activation_offload.py: on CUDA copied to pinned memory on a side stream,
    overlapping compute). auto = off, unless memory.levers auto chooses it."""
    activation_offload_bandwidth_gb_s: float = 25.0
    """Copy rate (GB/s) charged for offloaded activations. The planner charges the copies at this
    rate (10^9 bytes/s) where it cannot time them: a CPU run (host and device are one memory) and
    memtrain plan. Default: PCIe 4.0 x16 (31.5 GB/s raw; ~25 GB/s for pinned copies)."""
    # end of the levers' fields
    allow_lossy_levers: bool = False
    """With memory.levers auto and optimizer.state_dtype fp32: the placement planner may also keep
    AdamW's moments in bf16 or int8 (DDP and FSDP2; int8 needs torchao) where that lets a faster
    plan fit — chosen before the model is built (a lossier dtype only where predicted more than 5%
    faster than a less lossy one that fits), kept on resume, recorded in plan.json, placement.json
    and the checkpoint's engine spec. Lossy: the moments are rounded every step. ``memtrain plan``
    shows each dtype's bytes either way."""
    cuda_memory_cap_gib: float = 0.0
    """Cap this process's CUDA memory (torch.cuda.set_per_process_memory_fraction) to this many
    GiB, to reproduce a smaller GPU; 0 = no cap. Ignored on CPU."""
    host_memory_gib: float = 0.0
    """Host memory (GiB) the run's ranks on this machine may use together: a placement predicted
    to need more (offloaded state, pinned buffers, the processes themselves) is refused before
    the model is built; 0 = the memory available when the run starts."""
    grow_back_window: int = 50
    """After this many OOM-free optimizer steps, try the previous (2×) micro-batch again; the
    window doubles after each failed try. 0 = never grow back."""
    host_allocator_thresholds: Optional[bool] = None
    """glibc (Linux) malloc's mmap and trim thresholds (memtrain/host_allocator.py). null
    (default): a CPU run fixes both at glibc's starting 128 KiB in any process, so what a step
    frees goes back to the OS and the resident set follows the host bytes the plan counts (at the
    price of page-faulting activations in again every step); a GPU run run by the ``memtrain``
    command fixes them at 32 / 64 MiB, so freed blocks stay for the next micro-batch (up to 64 MiB
    free at the top of each malloc arena), and one run by ``memtrain.Trainer`` in a user's process
    leaves them alone (glibc cannot read back or undo them). true: 32 / 64 MiB on any run (a CPU
    run's speed, its resident set then above the plan); false: glibc left alone. The user's own
    ``MALLOC_*`` threshold variables, a ``glibc.malloc`` tunable or a preloaded
    jemalloc/tcmalloc/mimalloc always win."""


@dataclass
class FaultsConfig:
    """Fault injection for tests and benchmarks (raises real torch.OutOfMemoryError inside the model).
    Kills and hangs fire once per output folder (a marker in ``output_dir/faults_fired/`` records
    them), so a run restarted by an elastic launcher continues past them."""

    memory_budget_mib: float = 0.0
    """A simulated device memory of this many MiB per rank (0 = off): the engine's model-state bytes
    plus the bytes autograd saves for backward, counted as they are saved; a save past the budget
    raises a real torch.OutOfMemoryError (memtrain/memory/simulated.py)."""
    perturb_sample_at_step: int = 0
    """Change one sample of this optimizer step's batch on rank ``perturb_rank`` (its token ids
    reversed) before it is trained: the step's batch_fingerprint must change; 0 = off."""
    perturb_rank: int = 0
    """The rank whose batch ``perturb_sample_at_step`` changes."""
    oom_above_tokens: int = 0
    """Raise OOM in a micro-batch holding more than this many tokens (0 = off)."""
    oom_ranks: Optional[list[int]] = None
    """Ranks that raise (None = all)."""
    oom_in: Literal["forward", "backward", "eval"] = "forward"
    """Raise from the first block's forward pre-hook, from its backward, or in evaluation forwards."""
    oom_until_step: int = 0
    """Inject only up to this optimizer step (0 = for the whole run); lets a test watch grow-back."""
    oom_at_steps: Optional[list[int]] = None
    """Inject OOMs only at these optimizer steps (rare long inputs: memory spikes); None = every step."""
    oom_in_optimizer_at_step: int = 0
    """Raise a torch.OutOfMemoryError in this optimizer step's optimizer update on ``oom_ranks``,
    outside the OOM protocol (an OOM that escapes the agreement ends the run; a restarted run
    starts at a smaller plan); once per output folder; 0 = off."""
    nan_at_step: int = 0
    """Make this optimizer step's loss (and so its gradients) NaN on every rank, by poisoning
    the first block's input in training forwards; 0 = off."""
    nan_steps: int = 1
    """With ``nan_at_step``: how many consecutive steps are poisoned."""
    kill_at_step: int = 0
    """End the process with ``os._exit(137)`` right after this optimizer step (after its
    checkpoint, if one is due); 0 = off."""
    kill_ranks: Optional[list[int]] = None
    """With ``kill_at_step``: the ranks that are killed (None = all)."""
    kill_mid_step: bool = False
    """With ``kill_at_step``: end the process inside that step instead, after its first
    micro-batch's backward (in the middle of gradient accumulation)."""
    hang_at_step: int = 0
    """Make the ranks in ``hang_ranks`` stop inside this optimizer step, after their first
    micro-batch's backward, as a rank stuck in a collective or on a file system would (the others
    wait in the step's next collective); 0 = off. Ends by ``backend.timeout_s``."""
    hang_ranks: list[int] = field(default_factory=lambda: [0])
    """The ranks that ``hang_at_step`` stops."""
    save_error_ranks: Optional[list[int]] = None
    """Make writing every checkpoint fail (an OSError) on these ranks, after the engine's state
    is written; None = off. Shows that a rank-local failure reaches every rank."""
    kill_during_save: int = 0
    """End the process half-way through writing this step's checkpoint (engine state written,
    no manifest yet); 0 = off."""
    arm_oom_agreements: bool = False
    """Make the OOM protocol's agreement points inside compute (before each block of a sharded
    engine, between micro-batches, after each evaluation batch) on a CPU run too. On the CPU only
    ``memory_budget_mib`` and ``oom_above_tokens`` can raise an out-of-memory error there (a failed
    host allocation is another error), so without them each step agrees only at its close; true
    = as on a GPU, to measure what the points cost (benchmarks/overhead.py --armed)."""


@dataclass
class CheckpointConfig:
    """Crash-safe checkpoints (layout in docs/design.md, "Checkpoints")."""

    every_steps: int = 0
    """Save every this many optimizer steps and after the last one; 0 = only on a preemption
    signal (SIGTERM/SIGUSR1)."""
    keep_last: int = 2
    """Complete checkpoints to keep (the newest is never deleted)."""
    keep_best: Optional[str] = None
    """An evaluation metric as recorded (``val_loss``, or ``val_<name>`` of a Python caller's
    ``compute_metrics``): the checkpoint of its best value is never deleted, kept beside the
    ``keep_last`` newest; null = off. Needs evaluations at the saved steps (``every_steps`` a
    multiple of ``training.eval_every``)."""
    keep_best_mode: Literal["min", "max"] = "min"
    """Whether the lowest (``min``) or the highest (``max``) value of ``keep_best`` is the best."""
    async_save: bool = False
    """FSDP2: write the torch.distributed.checkpoint shards in a background thread; the commit
    (manifest, rename, ``latest``) happens at the next save or at the end of the run."""
    export: bool = True
    """Write the trained model to ``output_dir/model`` at the end (``memtrain export``'s folder).
    false: no export (a benchmark's run, say), and the placement planner leaves out its moment
    (the whole model gathered on rank 0's host); with ``every_steps`` 0 the trained weights are
    then not kept at all, which the run warns about at its start."""
    format: str = "auto"
    """The checkpoint format the engine writes: auto = its own (DDP safetensors, FSDP2 dcp,
    DeepSpeed deepspeed), or another format that saves the model as the engine holds it
    (``dcp`` under DDP: a shard file per rank, resharded on load; memtrain/checkpoint/formats/).
    A checkpoint is always read by the format its manifest names, so a resumed run may change it."""
    max_shard_size: str = "5GB"
    """DDP model files and exports: split ``model.safetensors`` into shards of at most this size
    (with a ``model.safetensors.index.json``), as transformers' ``save_pretrained`` does."""


@dataclass
class LoggingConfig:
    """Where the per-step scalars go besides ``metrics.jsonl`` (which is always written)."""

    log_with: list[str] = field(default_factory=list)
    """Accelerate tracker names (``tensorboard``, ``wandb``, ``mlflow``, ``aim``, ``comet_ml``,
    ``clearml``, ``dvclive``, ``trackio``, ``swanlab``) or ``all``: the same scalars as
    ``metrics.jsonl``, sent through Accelerate's trackers on rank 0, logged under
    ``output_dir/trackers``."""
    memory_breakdown_step: int = 0
    """Count this optimizer step's tensor memory with torch's MemTracker, entered before the model
    is built (every tensor: model state, engine buffers, activations, temporaries), and write its
    peak per rank and category to ``output_dir/memory_breakdown/rank_XXXXX.json``
    (memtrain/memory/breakdown.py), with the peak before the step (the model's build, the
    engine's set-up, a resume's checkpoint load) and, when it is the run's last step, the
    export's; 0 = off. Slows the steps up to it. Not with
    optimizer.state_dtype int8 (torch.compile, which its step uses, refuses MemTracker)."""


@dataclass
class Config:
    """A whole run."""

    output_dir: str = "runs/default"
    """Where metrics.jsonl, summary.json and model/ are written."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """auto = bf16 where the device supports it natively, else fp32 (never fp16)."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    debug: bool = False
    """Print the Python traceback of an error (by default an error is one message and its exit
    code). ``--debug`` alone means true."""
    resume: str = "auto"
    """auto = continue from ``output_dir/checkpoints/latest`` when a complete checkpoint exists
    (falling back to older complete ones); never = start fresh; or the path of a checkpoint."""


def _parser(show_all: bool = False, helps: bool = True):
    """The trainer's parser; with ``helps``, its help gives each option its field's first
    docstring sentence and hides the test-only ``faults.*`` options unless ``show_all``
    (:mod:`memtrain.cli_help`). Without, the options have no help text: reading the docstrings
    parses every config class's source (0.06–0.14 s of each rank's start-up on the 2-core CPU
    machine), and only a help request prints them."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(prog="memtrain train", exit_on_error=False, allow_abbrev=False,
                            usage="memtrain train [--config RECIPE.yaml] [--SECTION.KEY VALUE ...]",
                            description="Train with memtrain: a recipe plus --section.key overrides (the same keys as "
                                        "the recipe's). --help_all also lists the fault-injection options of tests.")
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML recipe (recipes/*.yaml)")
    parser.add_class_arguments(Config)
    if helps:
        describe(parser, Config, show_all)
    return parser


def _to_dataclass(cls, value: dict, prefix: str = ""):
    """Build dataclass ``cls`` (recursively) from the nested dict jsonargparse returns.

    Raises:
        ConfigError: a section given a value instead of a mapping of its keys (field: the section).
    """
    import typing

    value = {} if value is None else value  # a recipe section whose keys are all commented out
    if not isinstance(value, dict):
        raise ConfigError(prefix.rstrip("."), not_a_section(Config, prefix.rstrip(".")))
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in value:
            sub = value[f.name]
            kwargs[f.name] = (_to_dataclass(hints[f.name], sub, f"{prefix}{f.name}.")
                              if dataclasses.is_dataclass(hints[f.name]) else sub)
    return cls(**kwargs)


def parse_args(argv: Optional[list[str]] = None) -> Config:
    """Parse a command line into a :class:`Config`.

    Args:
        argv: arguments without the program name; None = ``sys.argv[1:]``.

    Returns:
        The config, with ``--model.config.KEY`` overrides merged into ``model.config``.

    Raises:
        ConfigError: unknown key, wrong type or value outside the allowed choices; the message
            names the field (e.g. ``training.max_steps``) and what is expected.
    """
    import argparse
    import sys

    argv = join_negative_numbers(list(sys.argv[1:] if argv is None else argv))
    rest, extra = strip_launcher_args(argv)
    for i, arg in enumerate(rest):  # a key given twice in a recipe is refused, not silently overwritten
        path = rest[i + 1] if arg == "--config" and i + 1 < len(rest) else arg.partition("=")[2] if arg.startswith("--config=") else None
        if path and os.path.isfile(path):
            check_recipe(path)
    show_all = "--help_all" in rest
    parser = _parser(show_all, helps=bool({"-h", "--help", "--help_all"} & set(rest)))
    try:
        ns = parser.parse_args(["--help" if arg == "--help_all" else arg for arg in rest])
    except argparse.ArgumentError as exc:  # jsonargparse names the key in its message
        raise ConfigError(*explain_parse_error(parser, Config, rest, str(exc))) from None
    d = ns.as_dict()
    d.pop("config", None)
    d.pop("__path__", None)
    cfg = _to_dataclass(Config, d)
    cfg.model.config = {**(cfg.model.config or {}), **extra["model_config"]}
    if extra.get("deepspeed"):  # the DeepSpeed launcher's --deepspeed FILE
        cfg.backend.deepspeed_config = extra["deepspeed"]
    _rename_deprecated(cfg)
    _expand_user_paths(cfg)
    return cfg


DEPRECATED_KEYS = {
    "memory.checkpoint_every": "memory.activation_checkpointing_every_n_blocks",
    "data.speech.max_frames_per_micro_batch": "data.speech.max_audio_samples_per_micro_batch",
}
"""Old key → its new name. An old key still works (with a warning) unless it contradicts the new one."""


def _rename_deprecated(cfg: Config) -> None:
    """Move values given under a deprecated key to the new key, with a warning.

    Raises:
        ConfigError: both keys set to different values.
    """
    import logging

    for old, new in DEPRECATED_KEYS.items():
        *path, old_name = old.split(".")
        section = functools.reduce(getattr, path, cfg)
        value = getattr(section, old_name)
        if value is None:
            continue
        new_name = new.rsplit(".", 1)[1]
        current, default = getattr(section, new_name), getattr(type(section)(), new_name)
        if current != default and current != value:
            raise ConfigError(old, f"is a deprecated name of {new}, and the two are set to different values "
                              f"({value} and {current}); keep only {new}")
        logging.getLogger("memtrain").warning("memtrain: %s is deprecated; use %s", old, new)
        setattr(section, new_name, value)
        setattr(section, old_name, None)


def _guarded_setattr(self, name: str, value) -> None:
    """Every section's ``__setattr__``: fields can be set until :func:`freeze` (after validation)."""
    if getattr(self, "_frozen", False):
        raise FrozenConfigError(f"the config is read-only after validation (setting {type(self).__name__}.{name}); "
                                "resolved values belong in the engine spec or the plan")
    object.__setattr__(self, name, value)


SECTIONS = (SpeechDataConfig, DataConfig, ModelConfig, TrainingConfig, OptimizerConfig, BackendConfig, MemoryConfig, FaultsConfig,
            CheckpointConfig, LoggingConfig, Config)
for _section in SECTIONS:  # set after the classes exist, so jsonargparse sees plain dataclasses
    _section.__setattr__ = _guarded_setattr


def freeze(cfg) -> None:
    """Make ``cfg`` and every section read-only (:class:`FrozenConfigError` on a write); called
    at the end of :func:`memtrain.validation.validate`."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, SECTIONS):
            freeze(value)
    object.__setattr__(cfg, "_frozen", True)


def _expand_user_paths(cfg: Config) -> None:
    """``~`` in the folders later readers open (``model.pretrained``, ``backend.nvme_path``)."""
    if cfg.model.pretrained is not None:
        cfg.model.pretrained = os.path.expanduser(cfg.model.pretrained)
    if cfg.backend.nvme_path is not None:
        cfg.backend.nvme_path = os.path.expanduser(cfg.backend.nvme_path)


def to_dict(cfg: Config) -> dict:
    """The config as plain JSON-serialisable data (for summaries and checkpoints)."""
    return dataclasses.asdict(cfg)
