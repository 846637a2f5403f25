"""The data fingerprint's hash (memtrain.fingerprint) taken in column chunks: the same digest
whatever the chunk width, and the same column weights whatever width was asked for before."""

import torch

from memtrain import fingerprint


def test_a_digest_does_not_depend_on_the_chunk_width(monkeypatch):
    """A speech-like micro-batch (float waveforms 10,001 samples wide, padded with zeros; int64
    labels with -100 padding): the digest with one chunk per row, chunks of 4,096 columns and chunks
    of 3 columns is one value (int64 sums modulo 2**64 in any split), and it changes when one
    sample's value does."""
    g = torch.Generator().manual_seed(0)
    batch = {"input_values": torch.randn(4, 10_001, generator=g),
             "labels": torch.randint(0, 30, (4, 17), generator=g)}
    batch["input_values"][1, 9_000:] = 0.0
    batch["labels"][2, 10:] = -100
    digests = []
    for chunk in (1 << 30, 4_096, 3):
        monkeypatch.setattr(fingerprint, "CHUNK_COLUMNS", chunk)
        digests.append(int(fingerprint.micro_batch_digest(batch)))
    assert digests[0] == digests[1] == digests[2]
    batch["input_values"][3, 5_000] += 1.0
    assert int(fingerprint.micro_batch_digest(batch)) != digests[0]


def test_column_weights_are_the_seeded_draw_whatever_was_asked_before(monkeypatch):
    """One weight tensor per name is kept at the widest width asked; a narrower one is its prefix,
    which must equal the seeded draw of that width made afresh (what the digest was before)."""
    monkeypatch.setattr(fingerprint, "_weights", {})
    fresh = fingerprint._column_weights("input_values", 5, torch.device("cpu")).clone()
    monkeypatch.setattr(fingerprint, "_weights", {})
    fingerprint._column_weights("input_values", 70_000, torch.device("cpu"))
    assert torch.equal(fingerprint._column_weights("input_values", 5, torch.device("cpu")), fresh)
    assert len(fingerprint._weights) == 1  # not one per width


def test_the_planner_counts_the_column_weights_the_digest_keeps(monkeypatch):
    """``weight_bytes`` (counted by the planner with the rank's batch, held for the whole run) is
    what ``micro_batch_digest`` keeps alive for a speech-like micro-batch: the bytes of the column
    weights' storages, read from the kept tensors themselves."""
    monkeypatch.setattr(fingerprint, "_weights", {})
    batch = {"input_values": torch.randn(4, 10_001), "attention_mask": torch.ones(4, 10_001, dtype=torch.int64),
             "labels": torch.randint(0, 30, (4, 17))}
    fingerprint.micro_batch_digest(batch)
    kept = sum(w.untyped_storage().nbytes() for w in fingerprint._weights.values())
    assert kept > 2 * 10_001 * 8 and fingerprint.weight_bytes(batch) == kept
    # a narrower batch after it leaves the wider weights kept: the planner sizes them from the
    # widest batch it traces (the longest utterances), not from the batch at hand
    narrow = {name: t[:, :5_000] if name != "labels" else t for name, t in batch.items()}
    fingerprint.micro_batch_digest(narrow)
    assert sum(w.untyped_storage().nbytes() for w in fingerprint._weights.values()) == kept > fingerprint.weight_bytes(narrow)


def test_a_run_keeps_only_its_own_weights_and_exports_without_them(monkeypatch, tmp_path):
    """A second run in one process starts without the first one's weights (a wider batch's, which
    its planner never counted), keeps its own while it trains (the digest's), and exports without
    them (the export's moment counts none): what the callbacks see at each moment."""
    import memtrain
    from memtrain.callbacks import TrainerCallback

    monkeypatch.setattr(fingerprint, "_weights", {})
    fingerprint.micro_batch_digest({"x": torch.ones(2, 50)})  # an earlier run's, 50 columns wide
    seen = []

    class Look(TrainerCallback):
        def on_train_begin(self, state):
            seen.append(("begin", max((w.numel() for w in fingerprint._weights.values()), default=0)))

        def on_step_end(self, state):
            seen.append(("step", max((w.numel() for w in fingerprint._weights.values()), default=0)))

        def on_train_end(self, state):
            seen.append(("end", len(fingerprint._weights)))

    examples = [{"x": torch.full((2,), float(i % 7))} for i in range(16)]
    settings = {"output_dir": str(tmp_path / "run"), "checkpoint": {"every_steps": 0},
                "training": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 2, "eval_every": 0}}
    memtrain.Trainer(settings, model=lambda: torch.nn.Linear(2, 1), train_dataset=examples,
                     objective=lambda m, mb: m(mb["x"]).pow(2).sum(), callbacks=[Look()]).fit()
    assert seen == [("begin", 0), ("step", 2), ("step", 2), ("end", 0)]
