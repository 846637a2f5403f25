"""Checks of a parsed :class:`memtrain.config.Config` that need several fields, the file system or
the model's own config: sizes and batch divisibility, values outside their meaning, data files,
sequence length against the model's positions, engine options for another engine, the output
folder. Every error is a :class:`memtrain.config.ConfigError` naming the field and what is
allowed, raised before anything is written to ``output_dir``.
"""

from __future__ import annotations

import glob
import os
from typing import Collection, Optional

from memtrain.backends import BACKENDS, check_writes_format, engine_module, engine_name
from memtrain.backends.spec import configured_engine
from memtrain.checkpoint.layout import check_run_folder
from memtrain.config import Config, ConfigError, freeze
from memtrain.data.hf_datasets import is_dataset_source
from memtrain.data.tokens import cache_setting, default_cache_dir
from memtrain.extras import require
from memtrain.folders import check_export_target, check_max_shard_size, nearest_existing
from memtrain.levers import validate as validate_levers
from memtrain.metrics import check_tracker_names
from memtrain.models import build_model, check_model_type, ctc_model_types


def _positive(name: str, value) -> None:
    if value is None or value <= 0:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")


def _validate_speech(cfg: Config) -> None:
    """``data.kind`` against the model's head, and the ``data.speech`` settings."""
    model_type = (cfg.model.config or {}).get("model_type")
    is_ctc = cfg.model.factory is None and model_type in ctc_model_types()
    if cfg.data.kind == "text":
        if is_ctc:
            raise ConfigError("data.kind", f"model_type '{model_type}' is a CTC speech model; set data.kind speech "
                              "(or choose a causal language model such as gpt2 or llama)")
        return
    if cfg.model.factory is not None or not is_ctc:
        raise ConfigError("model.config.model_type", f"data.kind speech needs a transformers CTC model; got "
                          f"{cfg.model.factory or model_type!r}; choose one of {', '.join(ctc_model_types())}")
    require("speech", "data.kind", "speech data (synthesis, audio files, word error rates)")
    sp = cfg.data.speech
    for name in ("train_utterances", "test_utterances", "min_words", "max_words"):
        _positive(f"data.speech.{name}", getattr(sp, name))
    if sp.min_words > sp.max_words:
        raise ConfigError("data.speech.min_words", f"{sp.min_words} is above data.speech.max_words {sp.max_words}")
    for name in ("bucket_batches", "max_audio_samples_per_micro_batch"):
        if getattr(sp, name) < 0:
            raise ConfigError(f"data.speech.{name}", f"must be >= 0 (0 = off), got {getattr(sp, name)}")


def _validate_batch(cfg: Config, world_size: int) -> None:
    """Sizes positive; the global batch divisible by micro-batch × world size; ``auto`` only with
    OOM recovery (the planner's probes agree on out-of-memory errors like steps)."""
    t = cfg.training
    for name in ("global_batch_size", "micro_batch_size", "max_steps"):
        if getattr(t, name) != "auto":
            _positive(f"training.{name}", getattr(t, name))
    _positive("data.seq_len", cfg.data.seq_len)
    _positive("data.vocab_size", cfg.data.vocab_size)
    if not 0.0 < cfg.data.validation_fraction < 1.0:
        raise ConfigError("data.validation_fraction", f"must be in (0, 1), got {cfg.data.validation_fraction}")
    if t.micro_batch_size == "auto" and not cfg.memory.oom_recovery:
        raise ConfigError("training.micro_batch_size", "auto needs memory.oom_recovery true (the planner's timed "
                          "probes agree on out-of-memory errors like training steps); give a number instead")
    micro = 1 if t.micro_batch_size == "auto" else t.micro_batch_size
    if t.global_batch_size % (micro * world_size) != 0:
        raise ConfigError(
            "training.global_batch_size",
            f"{t.global_batch_size} is not divisible by micro_batch_size × world_size = "
            f"{micro} × {world_size}; choose a global_batch_size that is a multiple of "
            f"{micro * world_size}, or a micro_batch_size dividing "
            f"{t.global_batch_size // world_size if t.global_batch_size % world_size == 0 else 'global_batch_size / world_size'}",
        )


def _validate_values(cfg: Config) -> None:
    """Numbers outside their meaning, an engine option for another engine, an output folder that
    cannot be one."""
    t = cfg.training
    if not t.lr > 0:
        raise ConfigError("training.lr", f"must be > 0 (the peak learning rate), got {t.lr}")
    for name, meaning in (("warmup_steps", "0 = no warmup"), ("max_grad_norm", "0 = no clipping"),
                          ("weight_decay", "0 = none"), ("eval_every", "0 = only after the last step")):
        if getattr(t, name) < 0:
            raise ConfigError(f"training.{name}", f"must be >= 0 ({meaning}), got {getattr(t, name)}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError("training.min_lr_ratio", f"must be in [0, 1] (final LR / peak LR), got {t.min_lr_ratio}")
    if t.eval_samples < 1:
        raise ConfigError("training.eval_samples", f"must be >= 1 (validation samples per evaluation; the run "
                          f"evaluates after its last step even with training.eval_every 0), got {t.eval_samples}")
    if t.compile and cfg.faults.memory_budget_mib:
        raise ConfigError("training.compile", "cannot be combined with faults.memory_budget_mib: the simulated device "
                          "counts each tensor saved for backward, which compiled blocks keep inside their own graph")
    if cfg.logging.log_with:  # an unknown tracker stops the run before any work

        check_tracker_names(cfg.logging.log_with)
    if not cfg.backend.timeout_s > 0:
        raise ConfigError("backend.timeout_s", f"must be > 0 (seconds a collective or one operation may take), "
                          f"got {cfg.backend.timeout_s}")
    _validate_placement(cfg)
    out = os.path.expanduser(cfg.output_dir)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError("output_dir", f"'{cfg.output_dir}' exists and is not a folder")

    parent = nearest_existing(out)
    if parent and not os.access(parent, os.W_OK):
        raise ConfigError("output_dir", f"'{cfg.output_dir}' cannot be written ('{parent}' is not writable)")
    check_run_folder(out)  # never over the user's own files of the names a run writes


def _pretrained_config(cfg: Config) -> dict:
    """The ``config.json`` of ``model.pretrained`` ({} when unset).

    Raises:
        ConfigError: not a folder with a readable ``config.json``, or set together with ``model.factory``.
    """
    import json

    path = cfg.model.pretrained
    if path is None:
        return {}
    if cfg.model.factory is not None:
        raise ConfigError("model.pretrained", "and model.factory are both set; a pretrained folder brings its own "
                          "model: drop one")
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ConfigError("model.pretrained", f"'{path}' is not a from_pretrained folder (no config.json in it); give "
                          "a local folder such as memtrain export's output")
    try:
        with open(config, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError("model.pretrained", f"'{config}' cannot be read: {exc}") from None


def check_config_keys(model_type: str, given: dict) -> None:
    """Every key of ``given`` (``model.config``) a setting of transformers' model type
    ``model_type``: one its config class declares, consumes or derives another setting from
    (``num_labels``, ``attn_implementation``, Phi-3's ``partial_rotary_factor``), or one its
    modeling code names. transformers keeps any other key as a stray attribute no code reads, so a
    misspelt ``n_layr`` would train the default size without a word.

    Raises:
        ConfigError: field ``model.config.KEY``, naming the closest settings of the class.
    """
    import difflib

    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    cls = type(defaults)
    for key, value in given.items():
        if key == "model_type" or key in vars(defaults) or hasattr(cls, key):
            continue
        try:
            probe = AutoConfig.for_model(model_type, **{key: value})
        except Exception:  # noqa: BLE001 - a value transformers refuses: _check_model_builds names it
            continue
        derived = {k: v for k, v in probe.to_dict().items() if k != key} != defaults.to_dict()
        if key not in vars(probe) or derived or _modeling_code_names(model_type, key):
            continue
        settings = [k for k in [*vars(defaults), *getattr(cls, "attribute_map", {})] if not k.startswith("_")]
        close = difflib.get_close_matches(key, settings, n=3, cutoff=0.6)
        raise ConfigError(f"model.config.{key}", f"is not a setting of transformers' {cls.__name__} "
                          f"(model_type {model_type}), which would keep it unused"
                          + (f"; did you mean {', '.join(close)}?" if close else ""))


def _modeling_code_names(model_type: str, key: str) -> bool:
    """Whether transformers' modeling source of ``model_type`` names ``key`` (read as text, not
    imported); True where the source cannot be found, so an unknown layout refuses nothing."""
    import importlib.util
    import re

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    try:
        spec = importlib.util.find_spec(f"transformers.models.{name}.modeling_{name}")
        with open(spec.origin, encoding="utf-8") as fh:
            return re.search(rf"\b{re.escape(key)}\b", fh.read()) is not None
    except (ImportError, AttributeError, TypeError, OSError):
        return True


def _check_model_builds(cfg: Config, mc: dict) -> None:
    """A transformers config that the model cannot be built from (a value of the wrong type, a
    width not divisible by the heads): named now, not after the data is built. Each key's type is
    checked against the config class's default, then the model is built on the meta device
    (nothing allocated).

    Raises:
        ConfigError: field ``model.config.KEY`` (a wrong type) or ``model.config`` (what
            transformers said).
    """
    import torch
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(mc["model_type"])
    check_config_keys(mc["model_type"], cfg.model.config or {})
    for key, value in (cfg.model.config or {}).items():
        default = getattr(defaults, key, None)
        if isinstance(default, (int, float)) and not isinstance(default, bool) and (
                isinstance(value, (str, bool, list, dict)) or (isinstance(default, int) and isinstance(value, float))):
            raise ConfigError(f"model.config.{key}", f"expects {'an integer' if isinstance(default, int) else 'a number'}"
                              f" (the {mc['model_type']} default is {default}), got {value!r}")

    try:
        with torch.device("meta"):
            build_model(cfg.model, int(mc.get("vocab_size") or cfg.data.vocab_size), eos_token_id=0)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises for a config it cannot build
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise ConfigError("model.config", f"transformers cannot build a {mc['model_type']} model from it: "
                          f"{type(exc).__name__}: {first}") from None


def user_optimizer_engines() -> str:
    """Why a Python caller's optimizer is refused under an engine or placement
    (:func:`check_user_optimizer_placement`), naming the engines that step it (each engine
    module's ``STEPS_USER_OPTIMIZER``) and where the others step their own (``OWN_OPTIMIZER``)."""
    ok = " or ".join(name for name in BACKENDS if engine_module(name).STEPS_USER_OPTIMIZER)
    own = "; ".join(words for words in (engine_module(name).OWN_OPTIMIZER for name in BACKENDS) if words)
    return (f"an optimizer_factory's optimizer runs under backend.name {ok} without offload ({own}): "
            f"choose {ok} with backend.offload none, or drop the factory")


def check_user_optimizer_placement(engine: str, offload: Optional[str]) -> None:
    """A Python caller's optimizer runs where memtrain hands the engine a torch optimizer to step
    as it is: an engine whose module says ``STEPS_USER_OPTIMIZER`` (DDP, FSDP2), without offload.
    Checked on the config (``auto`` passes) and again on the placement resolved from it
    (:func:`memtrain.build.optimizer_builders`).

    Raises:
        memtrain.config.ConfigError: an engine that does not step it (field ``backend.name``) or an
            offload (``backend.offload``).
    """
    if engine in BACKENDS and not engine_module(engine).STEPS_USER_OPTIMIZER:  # auto: checked once resolved
        raise ConfigError("backend.name", user_optimizer_engines())
    if offload not in (None, "none", "auto"):
        raise ConfigError("backend.offload", f"{offload}: {user_optimizer_engines()}")


def _validate_user_optimizer(cfg: Config) -> None:
    """An ``optimizer_factory`` keeps its own state: no DeepSpeed, no offload (its lossy state dtype:
    the lever's :meth:`memtrain.levers.optimizer_state.OptimizerStateDtype.validate`)."""
    check_user_optimizer_placement(cfg.backend.name, cfg.backend.offload)


def _validate_keep_best(cfg: Config) -> None:
    """``checkpoint.keep_best`` names a recorded evaluation metric, and every saved step is evaluated."""
    ck, every = cfg.checkpoint, cfg.training.eval_every
    if not ck.keep_best.startswith("val_"):
        raise ConfigError("checkpoint.keep_best", f"'{ck.keep_best}' is not an evaluation metric as recorded: val_loss, "
                          "or val_<name> of compute_metrics (CTC: val_wer, val_cer)")
    if ck.every_steps <= 0 or every <= 0 or ck.every_steps % every:
        raise ConfigError("checkpoint.keep_best", f"needs an evaluation at every saved step: checkpoint.every_steps "
                          f"({ck.every_steps}) a positive multiple of training.eval_every ({every})")


def _validate_python_inputs(cfg: Config, python: Collection[str]) -> None:
    """A model or data given from Python leaves the config's own unset (two models, or two
    datasets, named at once is refused, not one silently ignored); examples without a tokenizer give the config's
    model no vocabulary size; an optimizer factory runs where its optimizer is stepped as it is
    (:func:`_validate_user_optimizer`)."""
    if "optimizer_factory" in python:
        _validate_user_optimizer(cfg)
    if "model" in python and cfg.model.lora_rank:
        raise ConfigError("model.lora_rank", "is for the config's model; a model given from Python takes its LoRA "
                          "adapters from peft: pass peft.get_peft_model(model, peft.LoraConfig(...)) as the model")
    named = [f"model.{k}" for k in ("config", "factory", "pretrained") if getattr(cfg.model, k)]
    if "model" in python and named:
        raise ConfigError(named[0], "is set, and a model is given from Python too; drop one (e.g. "
                          f"--{named[0]} '{{}}', or a recipe without a model section)")
    if "train_dataset" in python and (cfg.data.files is not None or cfg.data.kind != "text"):
        key = "data.files" if cfg.data.files is not None else "data.kind"
        raise ConfigError(key, "is set, and a train_dataset is given from Python too; drop one")
    if ("train_dataset" in python and not {"model", "tokenizer"} & set(python) and not cfg.model.pretrained
            and "vocab_size" not in (cfg.model.config or {})):
        raise ConfigError("model.config.vocab_size", "is needed: the config's model takes its vocabulary from a "
                          "tokenizer, and a train_dataset without one gives none (set it, pass tokenizer=, or pass "
                          "the model)")


def _validate_lora(cfg: Config) -> None:
    """``model.lora_*`` in range; LoRA needs peft and trains without offload (the adapters'
    optimizer state is a small share of the model: nothing to gain from moving it)."""
    m = cfg.model
    if m.lora_rank < 0:
        raise ConfigError("model.lora_rank", f"{m.lora_rank}: must be 0 (off) or a positive rank such as 8")
    if not m.lora_rank:
        return
    if not 0 <= m.lora_dropout < 1:
        raise ConfigError("model.lora_dropout", f"{m.lora_dropout}: must be a probability in [0, 1)")
    if m.lora_alpha <= 0:
        raise ConfigError("model.lora_alpha", f"{m.lora_alpha}: must be positive (the update is scaled by "
                          "lora_alpha / lora_rank)")
    require("lora", "model.lora_rank", "LoRA")
    if cfg.backend.offload not in (None, "none", "auto"):
        raise ConfigError("backend.offload", f"{cfg.backend.offload}: LoRA trains without offload (its adapters' "
                          "optimizer state is a small share of the model); set backend.offload none or auto")
    if m.factory is not None and not m.lora_target_modules:
        raise ConfigError("model.lora_target_modules", "is needed with model.factory (peft knows the target "
                          "modules of transformers model types only): name them, e.g. [q_proj, v_proj]")


def _validate_model(cfg: Config) -> None:
    """A transformers model: its ``model_type`` known, its config buildable (:func:`_check_model_builds`),
    ``data.seq_len`` within its positions. A factory's model is checked when it is built."""
    _validate_lora(cfg)
    mc = {**_pretrained_config(cfg), **(cfg.model.config or {})}
    if cfg.model.factory is not None:
        return
    if "model_type" not in mc:
        raise ConfigError("model.config", "needs 'model_type' (e.g. gpt2, llama) unless model.factory is set")

    check_model_type(mc["model_type"])
    if not cfg.model.pretrained:
        _check_model_builds(cfg, mc)
    else:  # the pretrained folder's own keys are its; the config's are overrides of them
        check_config_keys(mc["model_type"], cfg.model.config or {})
    positions = mc.get("n_positions", mc.get("max_position_embeddings"))
    if positions is None:
        from transformers import AutoConfig

        positions = getattr(AutoConfig.for_model(mc["model_type"]), "max_position_embeddings", None)
    if positions is not None and cfg.data.seq_len > positions:
        raise ConfigError(
            "data.seq_len",
            f"{cfg.data.seq_len} is longer than the model's {positions} positions "
            "(model.config n_positions / max_position_embeddings); lower data.seq_len or raise the positions",
        )


def validate(cfg: Config, world_size: int, python: Collection[str] = ()) -> None:
    """Check cross-field constraints before any work is done.

    Args:
        cfg: the parsed config.
        world_size: number of ranks (processes) taking part.
        python: what a Python caller gives (:class:`memtrain.api.Trainer`): any of ``model``,
            ``train_dataset``, ``objective``, ``tokenizer`` (:func:`_validate_python_inputs`).

    Raises:
        ConfigError: with the field name: non-positive sizes; ``training.global_batch_size``
            not divisible by ``micro_batch_size × world_size``; ``data.files`` matching no file;
            ``data.seq_len`` longer than the model's positions; a model config without
            ``model_type`` and no ``model.factory``.
    """
    t = cfg.training
    _validate_batch(cfg, world_size)
    if cfg.data.files is not None:
        if not cfg.data.files:
            raise ConfigError("data.files", "is an empty list; give text/JSONL files or leave it unset for the default corpus")
        for pattern in cfg.data.files:
            matches = glob.glob(os.path.expanduser(pattern), recursive=True)
            if not matches:
                raise ConfigError("data.files", f"'{pattern}' matches no file")

            if all(os.path.isdir(m) and not is_dataset_source(m) for m in matches):
                raise ConfigError("data.files", f"'{pattern}' is a folder; give its files, e.g. "
                                  f"'{os.path.join(pattern, '**', '*.txt')}'")
    _validate_python_inputs(cfg, python)
    validate_levers(cfg, frozenset(python))  # each lever's own fields
    if "model" not in python:
        _validate_speech(cfg)
        _validate_model(cfg)
    ds = cfg.backend.deepspeed_config
    if ds is not None and not os.path.isfile(ds):
        raise ConfigError("backend.deepspeed_config", f"'{ds}' is not a file (a DeepSpeed JSON config is expected)")
    if ds is not None:  # read by the one reader of the JSON: a comment or trailing comma is named now, with its line
        configured_engine(cfg.backend)
    _validate_files_and_sizes(cfg)
    _validate_values(cfg)
    if t.gc_every_steps < 0:
        raise ConfigError("training.gc_every_steps", f"must be >= 0 (0 = Python's automatic garbage collector), "
                          f"got {t.gc_every_steps}")
    if t.max_nonfinite_steps < 1:
        raise ConfigError("training.max_nonfinite_steps", f"must be >= 1, got {t.max_nonfinite_steps}")
    ck = cfg.checkpoint
    if ck.every_steps < 0:
        raise ConfigError("checkpoint.every_steps", f"must be >= 0 (0 = only on a preemption signal), got {ck.every_steps}")
    if ck.keep_last < 1:
        raise ConfigError("checkpoint.keep_last", f"must be >= 1 (the newest complete checkpoint is always kept), "
                          f"got {ck.keep_last}")
    if ck.keep_best is not None:
        _validate_keep_best(cfg)
    if cfg.resume not in ("auto", "never") and not os.path.isdir(cfg.resume):
        raise ConfigError("resume", f"'{cfg.resume}' is neither auto, never nor a checkpoint directory")
    f = cfg.faults
    if f.hang_at_step and world_size < 2:
        raise ConfigError("faults.hang_at_step", "needs several ranks (the watchdog that ends a hung rank runs only then)")
    for name in ("kill_ranks", "hang_ranks", "oom_ranks"):
        outside = [r for r in (getattr(f, name) or []) if not 0 <= r < world_size]
        if outside:
            raise ConfigError(f"faults.{name}", f"ranks {outside} do not exist with world_size {world_size}")
    if f.kill_mid_step and not f.kill_at_step:
        raise ConfigError("faults.kill_mid_step", "needs faults.kill_at_step (the step to end in)")
    if cfg.model.factory is not None and ":" not in cfg.model.factory:
        raise ConfigError("model.factory", f"must look like 'package.module:function', got '{cfg.model.factory}'")
    freeze(cfg)  # read-only from here: what the launcher, the JSON and the planner decide goes into the engine spec


def _validate_files_and_sizes(cfg: Config) -> None:
    """``checkpoint.max_shard_size`` (parsed as the first save would), ``data.encoding`` (a codec
    Python knows), the data cache folder (``data.cache_dir`` or ``$MEMTRAIN_CACHE``) writable, and
    ``output_dir/model`` absent or an earlier export (the final export replaces only that)."""
    check_max_shard_size(cfg.checkpoint.max_shard_size)
    import codecs

    try:
        codecs.lookup(cfg.data.encoding)
    except LookupError:
        raise ConfigError("data.encoding", f"'{cfg.data.encoding}' is not an encoding Python knows; e.g. utf-8, "
                          "latin-1, cp1252, utf-16") from None

    cache = os.path.expanduser(cfg.data.cache_dir or default_cache_dir())
    parent = nearest_existing(cache)
    if parent and not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
        raise ConfigError(cache_setting(cache), f"the data cache '{cache}' cannot be written ('{parent}' is not a "
                          "writable folder); point MEMTRAIN_CACHE or data.cache_dir at a writable folder")
    check_export_target(os.path.join(os.path.expanduser(cfg.output_dir), "model"), [], "output_dir",
                        "the run exports its model there at the end. Move them, or give another output_dir")


def _validate_placement(cfg: Config) -> None:
    """``backend.offload``, ``nvme_path``, ``memory.host_memory_gib``,
    and the settings of one engine given for another (``zero_stage``; an engine setting that is a
    lever, ``reshard_after_forward``, is refused by its lever)."""
    b = cfg.backend
    engine = engine_name(b)  # auto: the launcher's, DeepSpeed with a zero_stage, else DDP
    engine_module(engine).validate(cfg)  # what this engine cannot honour, named by the engine
    check_writes_format(cfg, engine)
    if b.nvme_path is not None and not os.path.isdir(b.nvme_path):
        raise ConfigError("backend.nvme_path", f"'{b.nvme_path}' is not a folder (NVMe offload writes its files there)")
    if cfg.memory.host_memory_gib < 0:
        raise ConfigError("memory.host_memory_gib", f"must be >= 0 (GiB of host memory; 0 = what is available), got "
                          f"{cfg.memory.host_memory_gib}")


