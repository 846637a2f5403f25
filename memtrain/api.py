"""memtrain from Python: :class:`Trainer` trains a user's model on a user's data with everything the
command line does (every engine and launcher, the planner and OOM recovery, exact resume,
checkpoints, export, metrics and trackers). The command line is a user of this class.

    import memtrain

    trainer = memtrain.Trainer({"training": {"max_steps": 100}}, model=make_model, train_dataset=examples,
                               collate_fn=collate, args=sys.argv[1:])
    result = trainer.fit()

The script is what a launcher starts (``torchrun --nproc_per_node 2 script.py``, ``accelerate
launch``, ``deepspeed``): every rank builds the same :class:`Trainer` and calls :meth:`Trainer.fit`.
Errors are the exceptions the command line turns into exit codes (docs/operations.md): a bad
setting :class:`memtrain.ConfigError` (2), out of memory at the smallest plan :class:`memtrain.OOMStop`
(3), a checkpoint that cannot be saved or resumed :class:`memtrain.CheckpointError` (4), too many
non-finite steps :class:`memtrain.NonFiniteStop` (5).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Collection, Optional, Sequence, Union

from memtrain import host_allocator
from memtrain.build import UserInputs, build_trainer
from memtrain.callbacks import Callbacks
from memtrain.config import Config, parse_args, to_dict
from memtrain.distributed import ProcessState, prepare_libraries
from memtrain.errors import CollectiveError, ConfigError
from memtrain.folders import RunLock
from memtrain.launcher import apply_accelerate_settings
from memtrain.objectives import as_objective
from memtrain.validation import validate
from memtrain.watchdog import Watchdog, collective_failure_message, is_collective_failure, progress


def config_argv(config: Union[str, os.PathLike, dict, Config, None], args: Sequence[str] = ()) -> list[str]:
    """The command line equivalent to ``config`` (a recipe path, a dict of sections, a
    :class:`memtrain.config.Config`, or None for the defaults) followed by ``args``
    (``--section.key value`` overrides, such as a script's ``sys.argv[1:]``).

    Raises:
        memtrain.ConfigError: ``config`` is of another type (field ``config``).
    """
    if config is None:
        head: list[str] = []
    elif isinstance(config, (str, os.PathLike)):
        head = ["--config", os.fspath(config)]
    elif isinstance(config, (dict, Config)):
        head = ["--config", json.dumps(to_dict(config) if isinstance(config, Config) else config)]
    else:
        raise ConfigError("config", f"a recipe path, a dict or a memtrain Config; got {type(config).__name__}")
    return head + list(args)


def prepare_config(argv: Optional[list[str]] = None, python: Collection[str] = ()) -> Config:
    """Parse a command line, reconcile it with the user's Accelerate launcher settings
    (:mod:`memtrain.launcher`) and validate it against the launcher's world size (``WORLD_SIZE``);
    ``python``: what a Python caller gives (:func:`memtrain.validation.validate`).

    Raises:
        ConfigError: any invalid field, or a launcher setting contradicting one (named in the message).
    """
    import torch

    prepare_libraries(torch.cuda.is_available())  # validation builds the model: transformers imports
    cfg = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    apply_accelerate_settings(cfg, world_size)
    validate(cfg, world_size, python)
    return cfg


def run(cfg: Config, inputs=None, owns_process: bool = False, evaluate: bool = False, predict=None):
    """Train ``cfg`` (validated): the process state, the watchdog with several ranks
    (:mod:`memtrain.watchdog`), the training loop; returns the :class:`memtrain.loop.RunResult`.
    ``inputs``: a Python caller's model, data and objective (:class:`memtrain.build.UserInputs`;
    :class:`memtrain.api.Trainer`), None = all from ``cfg``. ``evaluate``: evaluate the run's last
    checkpoint instead (:meth:`memtrain.loop.TrainingLoop.evaluate`); ``predict`` (an
    :class:`memtrain.data.examples.ExampleDataset`): its outputs from that checkpoint. ``owns_process``: the ``memtrain``
    command runs it, so process-wide settings nobody else relies on may be tuned
    (``memory.host_allocator_thresholds`` null: :func:`memtrain.host_allocator.fix_thresholds`)."""
    from contextlib import ExitStack

    import torch

    progress("start-up", timed=False, context="")  # nothing left from an earlier run in this process
    with ExitStack() as closing:
        if int(os.environ.get("RANK", "0")) == 0:  # global rank 0 holds the run folder; nothing is written before
            closing.callback(RunLock(cfg.output_dir).acquire().release)
        enabled, return_freed = host_allocator.policy(cfg.memory.host_allocator_thresholds, owns_process,
                                                      cpu_run=not torch.cuda.is_available())
        # before the model and data allocate (looked up here: a test's stand-in is seen)
        host_allocator.fix_thresholds(enabled, return_freed=return_freed)
        prepare_libraries(torch.cuda.is_available())
        process = ProcessState(cpu=not torch.cuda.is_available(), timeout_s=cfg.backend.timeout_s)
        process.cap_cuda_memory(cfg.memory.cuda_memory_cap_gib)
        closing.callback(process.close)  # the engine is closed first, the lock released last
        if process.world_size > 1:  # alone, nobody waits on this rank
            closing.callback(Watchdog(cfg.backend.timeout_s, process.rank).start().stop)
        loop = build_trainer(cfg, process, closing, inputs)
        return loop.evaluate(predict) if evaluate or predict is not None else loop.run()


class Trainer:
    """A training run from Python.

    Args:
        config: a recipe path, a dict (``{"training": {"max_steps": 100}, ...}``), a
            :class:`memtrain.config.Config`, or None (the defaults).
        model: an ``nn.Module`` mapping the micro-batch's tensors to what the objective reads (for
            the default causal-LM objective: ``input_ids`` int64 [B, T] → logits [B, T, V], or an
            object with ``.logits``), or a zero-argument function that builds one. A function is
            called after memtrain seeds the run (the same weights on every rank) and inside the
            engine's build context (ZeRO-3 builds the model partitioned, never whole on a rank);
            a module built beforehand must be the same on every rank. None = ``model.*`` of the config.
        train_dataset: map-style dataset of examples (``len`` and ``[int]``; a ``datasets.Dataset``
            is read in torch format); None = ``data.*`` of the config.
        eval_dataset: validation examples (``training.eval_samples`` of them are evaluated);
            None with a ``train_dataset``: no evaluation. Several sets by name,
            ``{"name": dataset, ...}``: each evaluated in turn, recorded as ``val_<name>_loss``
            and ``val_<name>_<metric>``; ``val_loss`` is the first set's loss.
        collate_fn: list of examples → dict of tensors [B, …]; None = ``default_collate``.
        objective: the loss: None = causal LM (``input_ids``/``labels``, mean per label token) or
            CTC for speech data; a ``(model, micro_batch) -> summed loss`` function (mean per
            example); or an object with ``loss_sum(model, micro_batch)`` and ``count(batch)``
            (:class:`memtrain.objectives.UserObjective`).
        tokenizer: a ``transformers`` tokenizer saved with checkpoints and the exported model.
        callbacks: :class:`memtrain.TrainerCallback` instances whose hooks run on every rank at
            the run's moments (:mod:`memtrain.callbacks`; :class:`memtrain.EarlyStopping` ships).
        optimizer_factory: ``param_groups -> torch.optim.Optimizer``, called after the engine has
            wrapped or sharded the model with its trainable parameters in two groups (matrices
            with ``weight_decay`` = ``training.weight_decay``, the rest 0.0); DDP and FSDP2 without
            offload (:func:`memtrain.optim.user_optimizer`). None = memtrain's AdamW.
        scheduler_factory: ``optimizer -> torch.optim.lr_scheduler`` scheduler, stepped once per
            optimizer step. None = memtrain's warmup + cosine.
        compute_metrics: ``(outputs, labels) -> {name: float or (sum, count)}`` run on every rank
            after each evaluation micro-batch with what the model returned and the micro-batch's
            labels; reduced over the evaluation set and ranks and recorded as ``val_<name>``
            (:mod:`memtrain.eval_metrics`). None = the objective's metrics only.
        args: command-line overrides applied over ``config`` (``["--training.max_steps", "50"]``;
            a script passes ``sys.argv[1:]``).
        owns_process: the caller is memtrain's command line, whose process is memtrain's alone:
            process-wide settings may be tuned (glibc's malloc thresholds, unless
            ``memory.host_allocator_thresholds`` says otherwise). A Python caller leaves it False.

    Raises:
        memtrain.ConfigError: an invalid setting, one the launcher contradicts, or Python inputs
            that do not go together; nothing is written and no process group is started.
    """

    def __init__(self, config: Union[str, os.PathLike, dict, Config, None] = None, *, model: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, collate_fn: Optional[Callable] = None,
                 objective: Any = None, tokenizer: Any = None, callbacks: Sequence[Any] = (),
                 optimizer_factory: Optional[Callable] = None, scheduler_factory: Optional[Callable] = None,
                 compute_metrics: Optional[Callable] = None, args: Sequence[str] = (), owns_process: bool = False):
        if train_dataset is None and (eval_dataset is not None or collate_fn is not None or tokenizer is not None):
            raise ConfigError("train_dataset", "eval_dataset, collate_fn and tokenizer go with a train_dataset")
        objective = as_objective(objective) if objective is not None else None
        given = {"model": model, "train_dataset": train_dataset, "objective": objective, "tokenizer": tokenizer,
                 "optimizer_factory": optimizer_factory, "scheduler_factory": scheduler_factory}
        self.config: Config = prepare_config(config_argv(config, args), [k for k, v in given.items() if v is not None])
        try:
            hooks = Callbacks(callbacks)
        except TypeError as exc:
            raise ConfigError("callbacks", f"{exc} (subclass it and override its hooks)") from None
        except ValueError as exc:
            raise ConfigError("callbacks", str(exc)) from None
        for name, factory in (("optimizer_factory", optimizer_factory), ("scheduler_factory", scheduler_factory),
                              ("compute_metrics", compute_metrics)):
            if factory is not None and not callable(factory):
                raise ConfigError(name, f"must be a function, got {type(factory).__name__}")
        self.inputs = UserInputs(model, train_dataset, eval_dataset, collate_fn, objective, tokenizer, hooks,
                                 optimizer_factory, scheduler_factory, compute_metrics)
        self.owns_process = owns_process

    def fit(self):
        """Train to ``training.max_steps`` (resuming from ``output_dir``'s last checkpoint as
        ``resume`` says), then export the model to ``output_dir/model``.

        Returns:
            :class:`memtrain.loop.RunResult`: the trained (unwrapped) model, this rank's step
            records, and the run summary (also in ``output_dir/summary.json``).

        Raises:
            memtrain.ConfigError, memtrain.OOMStop, memtrain.CheckpointError,
            memtrain.NonFiniteStop: as the command line's exit codes 2-5;
            memtrain.CollectiveError: a collective failed or timed out (exit code 6 on the command
            line), in one line naming the rank, the operation and the cause.
            memtrain.CallbackError: a callback raised (on every rank, naming the callback, the
            hook and the rank).
        """
        return self._run(evaluate=False)

    def evaluate(self) -> dict:
        """Evaluate the run's last checkpoint in ``output_dir`` (after :meth:`fit`, or of a run
        trained before) on ``eval_dataset`` with the objective and ``compute_metrics``, as the run
        evaluates every ``training.eval_every`` steps; trains nothing and writes nothing.

        Returns:
            ``{"step": the checkpoint's step, "val_loss": …, "val_<metric>": …}``.

        Raises:
            memtrain.ConfigError: ``resume never`` (it would move the run aside), no checkpoint,
                no validation examples; and as :meth:`fit`.
        """
        if self.config.resume == "never":
            raise ConfigError("resume", "never would move the run's outputs aside; evaluate reads its last checkpoint "
                              "(resume auto, or a checkpoint path)")
        return self._run(evaluate=True)

    def predict(self, dataset) -> list:
        """The model's outputs for ``dataset``'s examples from the run's last checkpoint in
        ``output_dir``, as evaluation computes them (the objective's forward, micro-batched, an
        out-of-memory halving the micro-batch; the examples carry what the objective reads, for
        the default causal LM ``input_ids`` and ``labels``), every rank a share; trains nothing
        and writes nothing.

        Returns:
            One tensor per example, in ``dataset``'s order, on the CPU and the same on every rank:
            the logits (``[T, V]`` for a causal LM; a model returning a tensor: its row).

        Raises:
            memtrain.ConfigError: ``resume never``, no checkpoint, an empty ``dataset``; and as :meth:`fit`.
        """
        if self.config.resume == "never":
            raise ConfigError("resume", "never would move the run's outputs aside; predict reads its last checkpoint "
                              "(resume auto, or a checkpoint path)")
        return self._run(evaluate=False, predict=self.inputs.examples(dataset, "predict's dataset"))

    def _run(self, evaluate: bool, predict=None):
        try:
            return run(self.config, self.inputs, self.owns_process, evaluate, predict)
        except Exception as exc:  # noqa: BLE001 — only a failed collective is replaced
            if not is_collective_failure(exc) or isinstance(exc, CollectiveError):
                raise
            rank = int(os.environ.get("RANK", "0"))
            raise CollectiveError(collective_failure_message(exc, rank, self.config.backend.timeout_s)) from None
