"""Consolidated model export, from a live run or from any engine's checkpoint.

    memtrain export OUTPUT_DIR/checkpoints/step_00000100 OUT_DIR
    python -m memtrain.export OUTPUT_DIR/checkpoints/step_00000100 OUT_DIR

writes ``OUT_DIR/model.safetensors`` (sharded with ``model.safetensors.index.json`` past
``--max_shard_size``) and, for transformers models, ``config.json`` (and the tokenizer when the
checkpoint holds it), so ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it.
The weights are read by the format the checkpoint's manifest names (``checkpoint_format``:
safetensors, DDP's by default; torch.distributed.checkpoint, FSDP2's, read without a process
group; DeepSpeed's ``zero_to_fp32`` for ZeRO 1/2/3), on CPU in one process, never by an engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
from typing import Optional

import torch
from accelerate.utils import is_deepspeed_available
from torch import nn

from memtrain.checkpoint.formats import read_full_weights
from memtrain.checkpoint.layout import latest_checkpoint, verify
from memtrain.config import Config, ConfigError, _to_dataclass
from memtrain.distributed import prepare_libraries
from memtrain.errors import CheckpointError, OutputError
from memtrain.folders import (check_export_target, check_max_shard_size, is_disk_full, new_export_folder,
                              replace_export, write_error)
from memtrain.lora import is_peft_model, merged, save_adapter
from memtrain.models import build_model
from memtrain.weights import load_into, save_weights, share_tied

log = logging.getLogger("memtrain")


def export_model(model: nn.Module, state_dict: dict[str, torch.Tensor], directory: str, tokenizer=None,
                 max_shard_size: str = "5GB", about: Optional[dict] = None, setting: str = "OUT",
                 adapter_only: bool = False) -> str:
    """Write ``directory/model.safetensors`` (+ ``config.json`` and the tokenizer for transformers
    models), via a temporary folder of its own renamed into place, so a failed export never
    leaves a half-written model (:func:`memtrain.folders.replace_export`). Call on one process only.

    Args:
        model: the unwrapped module (for its class and transformers config).
        state_dict: the full (gathered) weights, on CPU.
        directory: target folder: new, empty, or an earlier export (replaced); anything else is
            refused. A symbolic link is followed.
        tokenizer: a ``transformers`` tokenizer saved beside the model, or None.
        max_shard_size: larger models are split into shards plus an index JSON.
        about: what the export came from (``step``, ``checkpoint``), kept in its marker.
        setting: what a full disk's message says to point elsewhere (``OUT``, or a run's ``output_dir``).
        adapter_only: a LoRA (peft) model's adapter folder instead of the merged model; a model
            without adapters ignores it. A peft model is otherwise exported merged
            (:func:`memtrain.lora.merged`): a model ``transformers`` loads without peft.

    Returns:
        The folder written (``directory`` with its links resolved).

    Raises:
        memtrain.config.ConfigError: ``directory`` holds files no export wrote, or cannot be
            written (nothing is written).
        memtrain.errors.OutputError: writing failed (a full disk: the folder and its free bytes
            named); the temporary folder is removed, an earlier export is untouched.
    """
    check_export_target(directory, [])
    tmp = new_export_folder(directory)
    try:
        if is_peft_model(model) and adapter_only:
            save_adapter(model, state_dict, tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        else:
            if is_peft_model(model):
                model, state_dict = merged(model, state_dict)
            _write_export(model, state_dict, tmp, tokenizer, max_shard_size)
        return replace_export(tmp, directory, about)
    except Exception as exc:  # noqa: BLE001 — safetensors reports a full disk as its own error type
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, OSError) and not is_disk_full(exc):
            raise
        raise OutputError(f"exporting the model to {directory} failed: {write_error(exc, directory, setting)}; nothing was "
                          "written there (an earlier export is untouched)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def preload_export_libraries(model: nn.Module) -> None:
    """Import now what exporting ``model`` at the run's end will import: transformers'
    ``save_pretrained`` unwraps the model through Accelerate's ``extract_model_from_parallel``,
    which imports DeepSpeed wherever it is installed (about 500 modules; 17 MiB of ``VmData``, 0.5 s
    on the 2-core CPU machine). Imported at the start, that memory is the process's from its
    first plan on, counted in what the planner subtracts from the host limit, instead of an import
    after the last step that a resource limit can refuse (seen under ``RLIMIT_DATA``: an export
    failing with ``failed to map segment from shared object``)."""
    if hasattr(model, "save_pretrained") and is_deepspeed_available():
        import deepspeed  # noqa: F401 - loaded for the export's unwrap (see above)


def _write_export(model: nn.Module, state_dict: dict[str, torch.Tensor], tmp: str, tokenizer, max_shard_size: str):
    """The export's files, into the new folder ``tmp`` (a tied parameter stored once: :func:`memtrain.weights.share_tied`)."""
    state_dict = share_tied(model, state_dict)
    if hasattr(model, "save_pretrained"):
        # memtrain took the config's LayerDrop over (memtrain.layerdrop.install_layerdrop, which
        # sets it to 0 in the live model); the exported config carries the user's value again.
        agreed = getattr(model, "memtrain_layerdrop", None)
        if agreed is not None:
            model.config.layerdrop = agreed.probability
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Writing model shards" bar in memtrain's output
        try:
            model.save_pretrained(tmp, state_dict=state_dict, max_shard_size=max_shard_size)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
            if agreed is not None:
                model.config.layerdrop = 0.0
        if tokenizer is not None:
            positions = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
            if positions:  # not tokenizers' "no limit" (1e30), so a pipeline truncates at the model's positions
                tokenizer.model_max_length = int(positions)
            tokenizer.save_pretrained(tmp)
    else:  # a plain nn.Module: its weights (and the tokenizer it was trained with, if any)
        save_weights(state_dict, tmp, max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def export_checkpoint(path: str, out: str, max_shard_size: str = "5GB", adapter_only: bool = False) -> str:
    """Export checkpoint ``path`` (a ``step_XXXXXXXX`` directory, or a run's ``checkpoints``
    directory, meaning its ``latest``) to ``out``.

    Returns:
        The folder written (``out`` with its links resolved).

    Raises:
        memtrain.errors.CheckpointError: the checkpoint is incomplete or corrupt (named file).
        memtrain.errors.OutputError: writing the export failed (:func:`export_model`).
        memtrain.config.ConfigError: ``out`` is, or lies inside, the checkpoint's run folder, or
            holds files no export wrote (:func:`memtrain.folders.check_export_target`); checked
            before anything is read or written; so is ``max_shard_size`` (field ``--max_shard_size``).
    """
    for folder in (path, os.path.join(path, "checkpoints")):  # checkpoints/ or a run folder: its latest
        named = latest_checkpoint(folder)
        if named is not None:
            path = named
            break
    check_export_target(out, _run_folders(path))
    check_max_shard_size(max_shard_size, "--max_shard_size")
    manifest = verify(path)
    cfg = _to_dataclass(Config, manifest["config"])
    state = read_full_weights(path, manifest)  # by the format the manifest names
    tokenizer = None
    if os.path.isdir(os.path.join(path, "tokenizer")):
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(path, "tokenizer"))
    # the run's model took its bos/eos ids from the tokenizer, not the model type's defaults
    model = build_model(cfg.model, manifest["vocab_size"], eos_token_id=getattr(tokenizer, "eos_token_id", None))
    load_into(model, state)
    if not hasattr(model, "save_pretrained"):
        tokenizer = None
    if adapter_only and not is_peft_model(model):
        raise ConfigError("--adapter_only", f"the run of {path} has no LoRA adapters (model.lora_rank 0): export "
                          "the whole model (drop --adapter_only)")
    return export_model(model, model.state_dict(), out, tokenizer, max_shard_size,
                        {"step": manifest.get("step"), "checkpoint": os.path.abspath(path)}, adapter_only=adapter_only)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals a scheduler or a closed terminal stops ``memtrain export`` with (Ctrl-C is Python's
``KeyboardInterrupt``): each ends the export cleanly, its temporary folder removed."""


class ExportStopped(BaseException):
    """``memtrain export`` was stopped by ``signum`` (a :data:`STOP_SIGNALS` signal); a
    ``BaseException``, so that only the export's cleanup catches it on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.signal_name = signal.Signals(signum).name


def _stop(signum, frame) -> None:
    raise ExportStopped(signum)


def _run_folders(path: str) -> list[str]:
    """The folders an export of checkpoint ``path`` must stay out of: the checkpoint, and the run
    folder holding its ``checkpoints/`` (when it is one)."""
    path = os.path.realpath(path.rstrip(os.sep))  # a link to a checkpoint protects the run it lies in
    parent = os.path.dirname(path)
    return [path] + ([os.path.dirname(parent)] if os.path.basename(parent) == "checkpoints" else [])


def main(argv: Optional[list[str]] = None, command: str = "export") -> int:
    """``memtrain export CKPT OUT``; returns the exit status: 2 for a refused checkpoint, target
    or ``--max_shard_size``, 4 when writing the export failed (a full disk), 128 + the signal's
    number when SIGTERM or SIGHUP stopped it (said in one line; its temporary folder removed)."""
    parser = argparse.ArgumentParser(prog=f"memtrain {command}", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoints/step_XXXXXXXX directory (or checkpoints/ or the run "
                                           "folder, for its latest)")
    parser.add_argument("out", help="directory to write model.safetensors and config.json into")
    parser.add_argument("--max_shard_size", default="5GB", help="split larger models into shards (default 5GB)")
    parser.add_argument("--adapter_only", action="store_true", help="a LoRA run: write the adapter folder (peft's "
                        "adapter_config.json and adapter_model.safetensors) instead of the merged model")
    args = parser.parse_args(argv)

    prepare_libraries(torch.cuda.is_available())
    previous = {sig: signal.signal(sig, _stop) for sig in STOP_SIGNALS}
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.max_shard_size, args.adapter_only)
    except ExportStopped as exc:  # the temporary folder is gone (export_model's cleanup); nothing else was touched
        print(f"memtrain export: stopped by {exc.signal_name}; nothing was written to {args.out} (an earlier export "
              "there is untouched)", file=sys.stderr)
        return 128 + exc.signum
    except OutputError as exc:
        print(f"memtrain export: {exc}", file=sys.stderr)
        return 4
    except (CheckpointError, ConfigError) as exc:
        print(f"memtrain export: {exc}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    link = f" (where the link {args.out} points)" if os.path.realpath(args.out) != os.path.abspath(args.out) else ""
    print(f"memtrain export: wrote {len(os.listdir(out))} files to {out}{link}", file=sys.stderr)
    print(json.dumps({"exported": out, "files": sorted(os.listdir(out))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
