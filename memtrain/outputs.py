"""The files a run writes at its end beside its checkpoints: the export (``output_dir/model``)
and what a rerun of a finished run finds missing. A mixin of :class:`memtrain.loop.TrainingLoop`
(its fields: the config, process state, engine, model, state, corpus, checkpointer)."""

from __future__ import annotations

import contextlib
import os
from typing import Optional

from memtrain.checkpoint.layout import read_summary
from memtrain.errors import CheckpointError, OutputError
from memtrain.export import export_model
from memtrain.folders import export_marker
from memtrain.watchdog import progress


class RunOutputs:
    """The export and the finished run's outputs, as :class:`memtrain.loop.TrainingLoop` methods."""

    def _unfinished_outputs(self) -> tuple[Optional[dict], list[str]]:
        """Rank 0: the run's ``summary.json`` and which of ``export`` and ``summary.json`` are
        missing or of another step than the state's (an export whose marker names no step, from
        an older memtrain, counts as made; none is missing under ``checkpoint.export`` false)."""
        step = self.state.step
        summary = read_summary(self.cfg.output_dir)
        marker = export_marker(os.path.join(self.cfg.output_dir, "model"))
        made = {"export": not self.cfg.checkpoint.export or (marker is not None and marker.get("step", step) == step),
                "summary.json": summary is not None and summary.get("steps") == step}
        return summary, [what for what, done in made.items() if not done]

    def _export_or_save(self) -> str:
        """The run's export; when it fails in a run that saved no checkpoint of its last step
        (``checkpoint.every_steps 0``), that step is saved so that a rerun can export it.

        Raises:
            memtrain.errors.OutputError: the export failed (the message says whether the
                checkpoint was saved instead, and where).
        """
        try:
            return self._export()
        except OutputError as exc:
            if self.cfg.checkpoint.every_steps:  # the last step is saved already: a rerun exports it
                raise
            try:
                self.checkpointer.save(self.state.step, self.checkpoint_states)
                self.checkpointer.finish()
            except CheckpointError as save_exc:
                raise OutputError(f"{exc}; saving a checkpoint of step {self.state.step} instead failed too "
                                  f"({save_exc}): the trained weights are lost with this process") from None
            raise OutputError(f"{exc}; step {self.state.step} was saved as a checkpoint instead (checkpoint.every_steps "
                              "0 saves none otherwise): make room and rerun the same command to export it") from None

    def _export(self, checkpoint: Optional[str] = None) -> str:
        """Write the consolidated model to ``output_dir/model`` (a collective for sharded engines);
        its marker names the step (and ``checkpoint``, the one it was made from on a rerun).

        Raises:
            memtrain.errors.OutputError: rank 0 could not write it (on every rank; a full disk named).
        """
        model_dir = os.path.join(self.cfg.output_dir, "model")
        progress("export", timed=False, context="")
        counting = self.breakdown.export_moment() if self.breakdown is not None else contextlib.nullcontext()
        with counting:  # logging.memory_breakdown_step: the export's moment, when it counted the last step
            state_dict = self.engine.full_state_dict(self.model)
            error, failure = None, None
            if self.process.is_main:
                try:
                    export_model(self.engine.unwrap(self.model), state_dict, model_dir, self.corpus.hf_tokenizer(),
                                 self.cfg.checkpoint.max_shard_size,
                                 {"step": self.state.step, **({"checkpoint": checkpoint} if checkpoint else {})},
                                 "output_dir")
                except Exception as exc:  # noqa: BLE001 — every rank must learn of it, or the others wait
                    failure, error = exc, str(exc) if isinstance(exc, OutputError) else (
                        f"rank 0: {type(exc).__name__} while exporting the model to {model_dir}: {exc}")
        error = self.process.broadcast_object(error, patient=True)  # rank 0 writes the files: however long that takes
        if failure is not None:
            raise failure
        if error is not None:
            raise OutputError(error)
        return model_dir
