"""Building a run, in one direction: process state → data → placement (engine, ZeRO stage,
offload; :mod:`memtrain.planning.placement`) → model → plan → engine → model transforms → the loop's parts.
The engine is built after the model exists, so that the plan can depend on the model.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from memtrain.backends import make_backend, model_build_context
from memtrain.models import repeated_blocks
from memtrain.callbacks import Callbacks
from memtrain.checkpoint import Checkpointer
from memtrain.checkpoint.compat import data_identity
from memtrain.checkpoint.layout import finished_without_checkpoint, move_previous_run
from memtrain.checkpoint.stateful import EngineState, RNGState, SchedulerState, TokenizerFiles
from memtrain.config import Config, ConfigError, to_dict
from memtrain.data import GlobalBatchSampler, build_corpus
from memtrain.data.corpus import SPLIT_RULE
from memtrain.data.examples import ExampleCorpus, ExampleDataset, named_sets
from memtrain.distributed import ProcessState
from memtrain.evaluate import Evaluator
from memtrain.export import preload_export_libraries
from memtrain.faults import FaultInjector
from memtrain.flops import flops_per_token, peak_bf16_flops
from memtrain.levers import LeverTarget, first_settings, offered_choices
from memtrain.loop import TrainingLoop
from memtrain.memory.accounting import device_state_bytes
from memtrain.memory.breakdown import MemoryBreakdown
from memtrain.memory.machine import run_host_limit
from memtrain.planning.run_placement import model_build_device, resolve as resolve_placement
from memtrain.planning.planner import build_planner
from memtrain.models import ModelSource, count_parameters
from memtrain.objectives import make_objective
from memtrain.oom import OOMSync, agrees_inside_compute
from memtrain.optim import make_optimizer, make_scheduler, state_bytes_per_element, user_optimizer, user_scheduler
from memtrain.validation import check_user_optimizer_placement
from memtrain.plan import Plan, PlanController
from memtrain.precision import NonFiniteGuard, resolve_precision
from memtrain.records import RecordTail
from memtrain.rng import capture, restore
from memtrain.state import TrainState
from memtrain.transforms import ModelTransforms

log = logging.getLogger("memtrain")


def make_sampler(cfg: Config, corpus, spec) -> GlobalBatchSampler:
    """The global-batch sampler over the data-parallel ranks of ``spec`` (an
    :class:`memtrain.backends.spec.EngineSpec`); speech corpora get length-aware batching
    (``data.speech.bucket_batches``)."""
    t, speech = cfg.training, cfg.data.speech if corpus.kind == "speech" else None
    return GlobalBatchSampler(len(corpus.train), t.global_batch_size, t.seed, spec.data_parallel_size,
                              spec.data_parallel_rank,
                              lengths=corpus.train.lengths if speech is not None else None,
                              bucket_batches=speech.bucket_batches if speech is not None else 0)


def make_controller(cfg: Config, data_parallel_size: int, choices: dict[str, tuple],
                    make_planner=None) -> PlanController:
    """The plan controller, starting from ``training.micro_batch_size`` (``auto``: the whole rank
    share of the ``data_parallel_size`` ranks until the planner chooses before step 1) and each
    lever's first choice (``choices``: :func:`memtrain.levers.lever_choices`)."""
    t = cfg.training
    per_rank = t.global_batch_size // data_parallel_size
    plan = Plan.for_global_batch(t.global_batch_size, per_rank if t.micro_batch_size == "auto" else t.micro_batch_size,
                                 data_parallel_size, first_settings(choices))
    return PlanController(plan, per_rank, cfg.memory.grow_back_window, choices, make_planner)


def planner_factory(cfg: Config, corpus, objective, precision: str, process: ProcessState,
                    state_bytes: Callable[[], dict[str, int]], choices: dict[str, tuple], source=None,
                    engine: Optional[str] = None):
    """What builds the run's planner on first use (:mod:`memtrain.planning.planner`), given the engine's
    model-state accounting (``state_bytes()``, called then), the levers' ``choices``, the
    model's :class:`memtrain.models.ModelSource` and the engine (``ddp|fsdp|deepspeed``: the one the
    placement chose, whose mixed precision the trace follows); None under
    ``faults.oom_above_tokens``, whose out-of-memory rule is not memory the planner could predict."""
    if cfg.faults.oom_above_tokens > 0:
        return None

    def make():
        """Called by every rank at the same point (before step 1, or at an agreed OOM)."""
        streams = capture()  # a trace may draw (SpecAugment)
        planner, error = None, None
        try:
            planner = build_planner(cfg, corpus, objective, precision, process.device,
                                    state_bytes(), cfg.training.global_batch_size // process.world_size,
                                    choices, source, engine)
        except Exception as exc:  # noqa: BLE001 - a model fake tensors cannot trace must not end the run
            error = exc
        restore(streams)
        # every rank plans with the smallest budgets (device, host), and either every rank has a planner or none
        gathered = process.all_gather_object((error is None, planner.budget_bytes if planner else None,
                                              planner.host_room_bytes if planner else None))
        if not all(ok for ok, _, _ in gathered):
            if process.is_main:
                log.warning("memtrain: the planner cannot trace this model (%s); out-of-memory recovery halves "
                            "the micro-batch instead", error or "on another rank")
            return None
        budgets, rooms = ([g[i] for g in gathered if g[i] is not None] for i in (1, 2))
        planner.restrict_budget(min(budgets) if budgets else None, min(rooms) if rooms else None)
        return planner

    return make


def pretrained_tokenizer(cfg: Config, is_main: bool) -> Optional[str]:
    """``model.pretrained`` when it holds a ``tokenizer.json`` (text runs), else None: the corpus
    is then tokenised with it instead of a BPE trained on the data."""
    path = cfg.model.pretrained
    if path and cfg.data.kind == "text" and os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    if path and cfg.data.kind == "text" and is_main:
        log.warning("memtrain: model.pretrained '%s' has no tokenizer.json: the BPE trained on data.files gives ids "
                    "its embeddings were not trained on", path)
    return None


@dataclass(frozen=True)
class UserInputs:
    """What a Python caller hands over in place of the config's (:class:`memtrain.api.Trainer`);
    each None = the config's.

    Attributes:
        model: an ``nn.Module``, or a zero-argument function building one (called after seeding,
            inside the engine's build context: ZeRO-3 builds it partitioned).
        train_dataset, eval_dataset: map-style datasets of examples (:mod:`memtrain.data.examples`).
        collate_fn: list of examples -> dict of tensors [B, …]; None = ``default_collate``.
        objective: an :class:`memtrain.objectives.Objective` (:func:`memtrain.objectives.as_objective`
            of what the caller gave).
        tokenizer: saved with checkpoints and exports.
        callbacks: the user's :class:`memtrain.callbacks.Callbacks` (empty: none).
        optimizer_factory: ``param_groups -> torch.optim.Optimizer`` (:func:`memtrain.optim.user_optimizer`);
            None = memtrain's AdamW.
        scheduler_factory: ``optimizer -> LR scheduler`` (:func:`memtrain.optim.user_scheduler`);
            None = memtrain's warmup + cosine (or the DeepSpeed JSON's).
        compute_metrics: ``(outputs, labels) -> {name: value}`` (:mod:`memtrain.eval_metrics`); None = none.
    """

    model: Any = None
    train_dataset: Any = None
    eval_dataset: Any = None
    collate_fn: Optional[Callable] = None
    objective: Any = None
    tokenizer: Any = None
    callbacks: Callbacks = field(default_factory=Callbacks)
    optimizer_factory: Optional[Callable] = None
    scheduler_factory: Optional[Callable] = None
    compute_metrics: Optional[Callable] = None

    def corpus(self, say: bool = True):
        """The :class:`memtrain.data.examples.ExampleCorpus` of the given datasets (``say``: this
        rank says what it changed, rank 0). With the
        default causal-LM objective, labels equal to the input ids (transformers' convention: the
        model shifts them) are shifted as transformers' models do, with a warning: memtrain's
        objective reads ``labels[t]`` as the token after ``input_ids[t]``."""
        train = self.examples(self.train_dataset, "train_dataset", say)
        named = {name: self.examples(data, f"eval_dataset[{name!r}]" if name else "eval_dataset", say)
                 for name, data in named_sets(self.eval_dataset).items()}
        validation = next(iter(named.values())) if named else ExampleDataset([], self.collate_fn, "eval_dataset")
        return ExampleCorpus(train, validation, self.tokenizer,
                             named if isinstance(self.eval_dataset, Mapping) else None)

    def examples(self, dataset, name: str, say: bool = True) -> ExampleDataset:
        """``dataset`` as an :class:`ExampleDataset` with the caller's collate function, its labels
        shifted where they follow transformers' convention (see :meth:`corpus`; ``name`` in the warning)."""
        split = ExampleDataset(dataset, self.collate_fn, name)
        if self.objective is None and split.unshifted_labels():
            split.shift_labels = True
            if say:
                log.warning("memtrain: %s: its labels equal its input_ids (transformers' convention, where the "
                            "model shifts them); memtrain's causal-LM objective reads labels[t] as the token "
                            "after input_ids[t], so it shifts them as transformers does (give labels shifted "
                            "already, or an objective, to train otherwise)", name)
        return split


def make_corpus(cfg: Config, process: ProcessState, inputs: UserInputs):
    """The run's data (the caller's examples, or ``data.*`` built and cached by rank 0 first);
    then, with ``resume never``, the previous run's outputs moved aside (after the data: a bad
    data file leaves the folder as it was).

    Raises:
        ConfigError: ``output_dir`` holds a finished run without a checkpoint and ``resume`` is
            ``auto`` (training again would replace its outputs; nothing is changed).
    """
    if cfg.resume == "auto":  # rank 0's folder decides, on every rank
        steps = process.broadcast_object(finished_without_checkpoint(cfg.output_dir) if process.is_main else None)
        if steps is not None:
            raise ConfigError("output_dir", f"{cfg.output_dir} holds a finished run ({steps} steps, summary.json) "
                              "and no checkpoint to resume from (checkpoint.every_steps 0 saves none); nothing was "
                              "changed. Train it again with --resume never (its outputs are moved into a "
                              "previous_run_ folder inside it), or choose another --output_dir")
    with process.main_process_first():
        corpus = (inputs.corpus(process.is_main) if inputs.train_dataset is not None
                  else build_corpus(cfg.data, pretrained_tokenizer(cfg, process.is_main)))
        if cfg.resume == "never" and process.is_main:
            moved = move_previous_run(cfg.output_dir)
            if moved:
                log.warning("memtrain: resume never: the previous run's outputs in %s were moved to %s",
                            cfg.output_dir, moved)
    if process.is_main:  # once per run (also when the cache is reused), each naming its file
        for warning in getattr(getattr(corpus, "tokenized", None), "decode_warnings", ()):
            log.warning("memtrain: %s", warning)
    if inputs.train_dataset is not None and process.world_size > 1:
        identities = process.all_gather_object(corpus.identity)
        if len(set(identities)) > 1:
            raise ConfigError("train_dataset", f"differs between ranks (identities {identities}): every rank must "
                              "build the same examples in the same order (seed or sort what you build)")
    return corpus


def warn_weights_not_kept(cfg: Config, process: ProcessState) -> None:
    """Rank 0 warns when the run will keep no trained weights: no export and no checkpoint saved."""
    if not cfg.checkpoint.export and not cfg.checkpoint.every_steps and process.is_main:
        log.warning("memtrain: checkpoint.export false and checkpoint.every_steps 0: the trained weights will not "
                    "be kept (only a stop signal saves a checkpoint)")


def build_trainer(cfg: Config, process: ProcessState, closing: ExitStack,
                  inputs: Optional[UserInputs] = None) -> TrainingLoop:
    """Everything the loop needs, from a validated config and a started process state.

    Args:
        cfg: the validated config.
        process: this process's state.
        closing: the engine's ``close`` is pushed here as soon as the engine exists.
        inputs: a Python caller's model, data and objective (None: all from ``cfg``).

    Raises:
        ValueError, memtrain.config.ConfigError: data or model settings that cannot work, an
            option the engine cannot honour.
    """
    t, inputs = cfg.training, inputs or UserInputs()
    precision = resolve_precision(cfg.precision, process.device.type)  # a refused precision stops before any work
    corpus = make_corpus(cfg, process, inputs)
    source = ModelSource.of(cfg, corpus, inputs.model)
    # the engine; backend.offload auto; the host budget
    spec = resolve_placement(cfg, corpus, process, precision, source, inputs.objective)
    from accelerate.utils import set_seed

    set_seed(t.seed)  # same initial weights on every rank
    breakdown = MemoryBreakdown(cfg.logging.memory_breakdown_step, cfg.output_dir, process.rank).start()
    closing.callback(breakdown.close)  # counts from before the model exists (logging.memory_breakdown_step)
    python_function = inputs.model is not None and not isinstance(inputs.model, torch.nn.Module)
    model = build_model_for(cfg, spec, precision, process, source, python_function)
    if isinstance(inputs.model, torch.nn.Module):
        check_same_model(model, process)
    preload_export_libraries(model)  # the export's imports: the process's memory from the first plan on
    # compute randomness (dropout, SpecAugment) differs by rank from here on, as Accelerate's
    # device-specific seeding does: still a pure function of (seed, rank), and each rank's streams
    # are replayed on OOM retries and saved in checkpoints
    set_seed(t.seed + process.rank)
    n_params, objective = count_parameters(model), inputs.objective or make_objective(model, corpus)
    layerdrop = getattr(model, "memtrain_layerdrop", None)  # memtrain.layerdrop.AgreedLayerDrop
    utilisation = model_flops(model, n_params, cfg.data.seq_len, objective.unit, precision, process.device)
    sampler = make_sampler(cfg, corpus, spec)
    # the planner is built on first use, after the engine below exists
    choices = offered_choices(cfg, spec, source, objective)
    make_planner = planner_factory(cfg, corpus, objective, precision, process, lambda: engine.model_state_bytes(n_params),
                                   choices, source, spec.name)
    controller = make_controller(cfg, spec.data_parallel_size, choices, make_planner)
    engine = make_backend(cfg, spec, process, precision, controller.plan)
    closing.callback(engine.close)
    host = run_host_limit(cfg)  # the host memory the ranks here may use, and what sets it
    # every rank makes the same agreement points: armed where any rank's host allocations can fail
    armed = any(process.all_gather_object(agrees_inside_compute(process.device.type, cfg.faults, host.fails_allocations)))
    sync = OOMSync(process.world_size, process.rank, enabled=cfg.memory.oom_recovery, device=process.device,
                   timeout_s=process.timeout_s, inside_compute=armed)
    closing.callback(sync.close)
    faults = FaultInjector(cfg.faults, process.rank, cfg.output_dir)
    transforms = ModelTransforms(LeverTarget(model, repeated_blocks(model), objective, cfg, faults), t.compile)
    build_optimizer, build_scheduler = optimizer_builders(cfg, inputs, spec, engine, controller.plan)
    model, optimizer = transforms.apply(model, engine, build_optimizer, sync, controller.plan)
    faults.simulate_memory(device_state_bytes(engine.model_state_bytes(n_params)), model.parameters())
    scheduler = build_scheduler(optimizer)
    evaluator = Evaluator(process, corpus, objective, t.eval_samples, controller.plan.micro_batch_size, sync,
                          inputs.compute_metrics, engine.unwrap)
    guard, state = NonFiniteGuard(t.max_nonfinite_steps), TrainState()
    if cfg.checkpoint.async_save and not engine.supports_async_save and process.is_main:
        log.warning("memtrain: checkpoint.async_save applies to backend.name fsdp only; %s saves synchronously",
                    engine.name)
    ck = cfg.checkpoint
    warn_weights_not_kept(cfg, process)
    checkpointer = Checkpointer(process, os.path.join(cfg.output_dir, "checkpoints"), ck.keep_last,
                                (ck.keep_best, ck.keep_best_mode) if ck.keep_best else None, ck.async_save,
                                {"vocab_size": corpus.vocab_size, "config": to_dict(cfg),
                                 "data_identity": data_identity(corpus), "data_split": SPLIT_RULE,
                                 "engine_spec": spec.as_dict()},
                                after_write=faults.after_checkpoint_write)
    checkpoint_states = {
        "model_and_optimizer": EngineState(engine, model, optimizer, cfg.checkpoint.max_shard_size),
        "scheduler": SchedulerState(scheduler, optimizer), "plan": controller, "train": state,
        "evaluator": evaluator, "nonfinite": guard, "rng": RNGState(process.rank, process.world_size),
        "tokenizer": TokenizerFiles(corpus.hf_tokenizer(), process.is_main), "records": RecordTail(),
    }
    return TrainingLoop(cfg, process, engine, model, optimizer, scheduler, corpus, objective, sampler, controller, sync,
                   faults, transforms, evaluator, guard, checkpointer, checkpoint_states, state, n_params, spec,
                   layerdrop, *utilisation, breakdown=breakdown, host_limit=host, callbacks=inputs.callbacks,
                   user_schedule=inputs.scheduler_factory is not None)


def build_model_for(cfg: Config, spec, precision: str, process: ProcessState, source: ModelSource,
                    python_function: bool) -> torch.nn.Module:
    """The run's model (seed first), built in the engine's context (ZeRO-3's partitioned build)
    and on the device where :func:`memtrain.planning.run_placement.model_build_device` says."""
    on_device = model_build_device(cfg, spec, precision, process.device, source)
    with model_build_context(cfg, spec, precision, process.world_size, python_function), \
            (on_device or contextlib.nullcontext()):  # a torch.device is a context: tensors made there
        return source.build()


def optimizer_builders(cfg: Config, inputs: UserInputs, spec, engine, plan: Plan):
    """``(model -> optimizer, optimizer -> LR scheduler)`` of the run: a Python caller's factories
    (checked against the placement; the state their optimizer keeps per element handed to the
    engine's accounting before the planner, built on first use, reads it), else memtrain's AdamW
    (in the plan's ``optimizer_state_dtype``) and schedule (or the DeepSpeed JSON's).

    Raises:
        memtrain.config.ConfigError: :func:`memtrain.validation.check_user_optimizer_placement`; a factory's return.
    """
    t, factory = cfg.training, inputs.optimizer_factory
    if factory is not None:
        check_user_optimizer_placement(spec.name, spec.offload)  # as resolved under backend.name/offload auto
        engine.optimizer_element_bytes = state_bytes_per_element(factory)
        build = lambda m: user_optimizer(factory, m, t)  # noqa: E731
    else:
        state_dtype = plan.settings().get("optimizer_state_dtype", "fp32")
        build = lambda m: make_optimizer(m, t, state_dtype)  # noqa: E731
    if inputs.scheduler_factory is not None:
        return build, lambda optimizer: user_scheduler(inputs.scheduler_factory, optimizer)
    return build, lambda optimizer: make_scheduler(optimizer, t, engine.scheduler_config)


def check_same_model(model: torch.nn.Module, process: ProcessState) -> None:
    """A module the user built before the run must be the same on every rank (a model function
    is called after memtrain seeds every rank alike); compared by a checksum of its tensors.

    Raises:
        memtrain.config.ConfigError: the ranks' modules differ (field ``model``).
    """
    if process.world_size == 1:
        return
    with torch.no_grad():
        local = [float(t.double().sum()) for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    if len(set(map(tuple, process.all_gather_object(local)))) > 1:
        raise ConfigError("model", "the module differs between ranks (each rank built its own random weights): seed "
                          "before building it (torch.manual_seed), or pass a function that builds it")


def model_flops(model, n_params: int, seq_len: int, unit: str, precision: str, device: torch.device) -> tuple:
    """``(training FLOPs per token, the device's peak FLOP/s)`` for the ``mfu`` metric of a
    language model trained in bf16/fp16 on a GPU of known peak (:mod:`memtrain.flops`); else Nones."""
    if unit != "tokens" or device.type != "cuda" or precision == "fp32":
        return None, None
    return flops_per_token(model, n_params, seq_len), peak_bf16_flops(torch.cuda.get_device_name(device))
