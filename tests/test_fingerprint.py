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
