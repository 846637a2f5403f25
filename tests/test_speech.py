"""The speech recipe: a deterministic synthetic corpus, CTC with LayerDrop on every engine
(2 CPU ranks, nothing set about unused parameters), length-aware batching, and OOM recovery on
long utterances."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import ENGINES, REPO, STEPS, launch, read_metrics

pytestmark = pytest.mark.xdist_group("speech")  # one xdist worker: the corpus and the 4 engines' runs are made once

SPEECH_ARGS = [
    "--config", str(REPO / "recipes" / "asr_ctc_wavlm_tiny.yaml"), "--precision", "fp32",
    "--data.speech.train_utterances", "64", "--data.speech.test_utterances", "8", "--data.speech.max_words", "5",
    "--data.speech.bucket_batches", "2",
    "--model.config.hidden_size", "32", "--model.config.intermediate_size", "64",
    "--model.config.num_attention_heads", "2", "--model.config.conv_dim", "[16, 16, 16, 16, 16, 16, 16]",
    "--model.config.num_conv_pos_embeddings", "16", "--model.config.num_conv_pos_embedding_groups", "4",
    "--model.config.mask_time_prob", "0",  # SpecAugment draws from NumPy per micro-batch shape
    "--training.global_batch_size", "8", "--training.micro_batch_size", "4", "--training.max_steps", str(STEPS),
    "--training.warmup_steps", "2", "--training.eval_every", "4", "--training.eval_samples", "8",
    "--checkpoint.every_steps", "0",
]


@pytest.fixture(scope="session")
def speech_cache(tmp_path_factory) -> str:
    """The test-size synthetic corpus, synthesised once per session."""
    path = tmp_path_factory.mktemp("speech_cache")
    from memtrain.config import parse_args
    from memtrain.data import build_corpus

    build_corpus(parse_args(SPEECH_ARGS + ["--data.cache_dir", str(path)]).data)
    return str(path)


def speech_args(out, cache, *extra) -> list[str]:
    return SPEECH_ARGS + ["--output_dir", str(out), "--data.cache_dir", cache, *extra]


# --- data -----------------------------------------------------------------------------------


def test_synthesis_is_a_pure_function_of_text_voice_and_seed():
    from memtrain.data.espeak import synthesize_many, voice_for

    texts = ["the file is closed", "return a new list", "the file is closed"]
    voices = [voice_for(7, 0), voice_for(7, 1), voice_for(7, 0)]
    first = synthesize_many(texts, voices, [11, 12, 11], workers=2)
    again = synthesize_many(texts[::-1], voices[::-1], [11, 12, 11], workers=1)[::-1]  # other order, one worker
    assert all(a.dtype == np.int16 and len(a) > 10000 for a in first)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert np.array_equal(first[0], first[2])  # eSpeak's state between utterances does not leak
    assert voice_for(7, 0) == voice_for(7, 0) and voice_for(7, 0, split=1) != voice_for(7, 0)
    other_voice = synthesize_many(texts[:1], [voice_for(7, 5)], [11])[0]
    assert voice_for(7, 5) != voices[0] and not np.array_equal(first[0][:len(other_voice)], other_voice[:len(first[0])])


def test_same_seed_and_index_give_identical_samples(speech_cache, tmp_path):
    """A second, smaller corpus built elsewhere holds the same first utterances, bit for bit."""
    from memtrain.config import parse_args
    from memtrain.data import build_corpus

    full = build_corpus(parse_args(SPEECH_ARGS + ["--data.cache_dir", speech_cache]).data)
    small = build_corpus(parse_args(SPEECH_ARGS + ["--data.cache_dir", str(tmp_path),
                                                   "--data.speech.train_utterances", "6",
                                                   "--data.speech.test_utterances", "2"]).data)
    assert small.directory != full.directory and len(small.train) == 6
    for i in range(6):
        assert small.train.texts[i] == full.train.texts[i]
        assert np.array_equal(small.train.waveform(i), full.train.waveform(i))
    assert set(full.train.texts).isdisjoint(full.validation.texts)
    assert all(set(t) <= set("abcdefghijklmnopqrstuvwxyz' ") for t in full.train.texts)
    batch = full.train.batch([3, 0, 5])
    lengths = batch["attention_mask"].sum(1)
    assert lengths.tolist() == sorted(lengths.tolist(), reverse=True)  # longest first
    assert batch["input_values"].dtype == torch.float32 and batch["labels"].dtype == torch.int64


def test_manifest_audio_is_read_resampled_and_split(tmp_path):
    import soundfile

    from memtrain.config import parse_args
    from memtrain.data import build_corpus

    lines = []
    for i, rate in enumerate([8000, 22050, 16000, 44100] * 3):
        t = np.arange(int(rate * (0.5 + 0.1 * i))) / rate
        soundfile.write(tmp_path / f"u{i}.flac", 0.3 * np.sin(2 * np.pi * 220 * t).astype(np.float32), rate)
        lines.append(json.dumps({"audio": f"u{i}.flac", "text": f"Hello, World #{i}!"}))
    (tmp_path / "m.jsonl").write_text("\n".join(lines))
    cfg = parse_args(SPEECH_ARGS + ["--data.files", json.dumps([str(tmp_path / "m.jsonl")]),
                                    "--data.validation_fraction", "0.3", "--data.cache_dir", str(tmp_path / "c")])
    corpus = build_corpus(cfg.data)
    assert len(corpus.train) + len(corpus.validation) == 12 and len(corpus.validation) > 0
    for ds in (corpus.train, corpus.validation):
        for i, text in enumerate(ds.texts):
            n = int(text.split()[-1])
            assert text == f"hello world {n}"
            assert abs(len(ds.waveform(i)) - round(16000 * (0.5 + 0.1 * n))) <= 2


def test_manifest_errors_name_the_line(tmp_path):
    import soundfile

    from memtrain.data.speech import read_manifests

    soundfile.write(tmp_path / "a.wav", np.zeros(1600, dtype=np.float32), 16000)
    (tmp_path / "m.jsonl").write_text(json.dumps({"audio": "a.wav", "text": "fine"}) + "\n"
                                      + json.dumps({"audio": "a.wav", "text": "?!"}) + "\n")
    with pytest.raises(ValueError, match=r"m.jsonl:2: the text '\?!' has no letters"):
        read_manifests([str(tmp_path / "m.jsonl")])
    (tmp_path / "n.jsonl").write_text(json.dumps({"audio": "missing.wav", "text": "x"}))
    with pytest.raises(ValueError, match=r"n.jsonl:1: audio file .*missing.wav' does not exist"):
        read_manifests([str(tmp_path / "n.jsonl")])


def test_bucketing_keeps_every_sample_once_and_groups_lengths():
    from memtrain.data import GlobalBatchSampler

    lengths = np.random.default_rng(0).integers(1000, 50000, size=203)
    plain = GlobalBatchSampler(203, 8, seed=3)
    bucketed = GlobalBatchSampler(203, 8, seed=3, lengths=lengths, bucket_batches=5)
    for epoch in (0, 1):
        seen = np.concatenate([bucketed.global_batch(bucketed.cursor(epoch * 25 + s)) for s in range(25)])
        assert len(seen) == len(set(seen.tolist())) == 200
    spread = [np.ptp(lengths[s.global_batch(s.cursor(k))]) for s in (plain, bucketed) for k in range(25)]
    assert np.mean(spread[25:]) < 0.5 * np.mean(spread[:25])
    other_world = GlobalBatchSampler(203, 8, seed=3, world_size=2, rank=1, lengths=lengths, bucket_batches=5)
    assert np.array_equal(other_world.global_batch(other_world.cursor(9)), bucketed.global_batch(bucketed.cursor(9)))


def test_the_planner_traces_a_speech_model_as_memtracker_counts_its_micro_step(speech_cache):
    """The planner's fake-tensor trace of the CTC model (fp32) against MemTracker on the real
    micro-step of the same longest utterances, activation checkpointing off and on: within 10%.
    The trace failed before: the model makes a tensor on the CPU in its constructor, SpecAugment
    and the micro-batch's trim read lengths, and CTC's output shapes depend on them. The rank's
    batch is counted beside the trace (``resident``): it is on the device for the whole step, as
    are the data fingerprint's column weights."""
    from test_planner import P, memtracker_micro_step_bytes

    from memtrain.levers.activation_checkpointing import enable_activation_checkpointing
    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import build_model, repeated_blocks
    from memtrain.objectives import make_objective
    from memtrain.planning.activations import activation_table, trace_batch

    cfg = parse_args(SPEECH_ARGS + ["--data.cache_dir", speech_cache, "--model.config.layerdrop", "0"])
    corpus = build_corpus(cfg.data)
    model = build_model(cfg.model, corpus.vocab_size, 0)
    objective = make_objective(model, corpus)
    traced = activation_table(cfg, corpus, objective, "fp32", "cpu")
    batch = trace_batch(corpus, 4)
    longest = int(corpus.train.lengths.max())  # the rank batch: 4 waveforms (fp32) and masks (int64) padded to it
    # and the data fingerprint's int64 weight per column of the waveforms, the masks and the labels
    weights = 8 * 2 * longest
    for micro in (4, 2):  # the same rank batch of 4 however it is split (at most its labels' padding apart)
        assert (4 * longest * (4 + 8) + weights <= traced.peaks(P(micro, "off", 4)).resident
                <= 4 * longest * (4 + 8) + 4 * 8 * 200 + weights + 8 * 200)
    for ac in ("off", "on"):
        if ac == "on":
            enable_activation_checkpointing(model, repeated_blocks(model))
        peaks = traced.peaks(P(4, ac, 4))
        digest_weights = sum(8 * t.reshape(len(t), -1).shape[1] for t in batch.values())  # no digest made below
        assert peaks.peak + peaks.resident - digest_weights == pytest.approx(
            memtracker_micro_step_bytes(model, objective, batch), rel=0.10), ac
    # the recipe's SpecAugment (masks drawn in NumPy from the lengths, one bool per frame) is left
    # out of the trace, on the inner model too (WavLMForCTC.wavlm holds its own reference to the config)
    masked = parse_args(SPEECH_ARGS + ["--data.cache_dir", speech_cache, "--model.config.layerdrop", "0",
                                       "--model.config.mask_time_prob", "0.05"])
    assert activation_table(masked, corpus, objective, "fp32", "cpu").peaks(P(4, "off", 4)) == traced.peaks(P(4, "off", 4))


def test_the_waveform_gets_no_gradient_and_nothing_outlives_a_micro_batch(speech_cache):
    """transformers' speech feature encoders mark the waveform as requiring a gradient when
    training (``_requires_grad``, for reentrant checkpointing); nothing reads it, and each
    micro-batch's [B, samples] fp32 gradient outlived the micro-batch until Python's cycle
    collector ran (MemTracker: the four micro-batches' of a step alive when the next began, the
    speech rows up to 7.9% under their prediction). The model memtrain builds computes the same loss
    and parameter gradients, bitwise, as with transformers' default, and two micro-batches leave
    no more memory alive than one (with the default, one waveform gradient more each)."""
    import copy
    import gc

    from torch.distributed._tools.mem_tracker import MemTracker

    from memtrain.config import parse_args
    from memtrain.data import build_corpus
    from memtrain.models import build_model
    from memtrain.objectives import make_objective
    from memtrain.planning.activations import trace_batch

    cfg = parse_args(SPEECH_ARGS + ["--data.cache_dir", speech_cache, "--model.config.layerdrop", "0",
                                    "--model.config.mask_time_prob", "0"])
    corpus = build_corpus(cfg.data)
    built = build_model(cfg.model, corpus.vocab_size, 0)
    default = copy.deepcopy(built)
    for module in default.modules():
        if type(module).__name__.endswith("FeatureEncoder"):
            module._requires_grad = True  # transformers' default
    objective, batch = make_objective(built, corpus), trace_batch(corpus, 2)

    def run(model) -> tuple[list, list[int]]:
        alive = []
        gc.disable()  # the leftover is freed by the cycle collector: never between the two micro-batches here
        with MemTracker() as tracker:
            tracker.track_external(model)
            for _ in range(2):
                tracker.reset_mod_stats()
                loss = objective.loss_sum(model, batch)
                loss.backward()
                value = loss.item()
                del loss
                alive.append(tracker.get_tracker_snapshot("current"))
        gc.enable()
        totals = [sum(snap["Total"] for snap in a.values()) for a in alive]
        return [value] + [p.grad.clone() for p in model.parameters()], totals

    (ours, ours_alive), (theirs, theirs_alive) = run(built), run(default)
    assert ours[0] == theirs[0] and all(torch.equal(a, b) for a, b in zip(ours[1:], theirs[1:]))
    assert ours_alive[1] == ours_alive[0]
    waveform_gradient = batch["input_values"].numel() * 4
    assert theirs_alive[1] - theirs_alive[0] >= waveform_gradient  # the switch matters: the default leaks one


def test_frame_cap_and_greedy_ctc_decoding():
    from memtrain.plan import Plan, PlanController
    from memtrain.objectives import CTC

    controller = PlanController(Plan(8, 1), 8, 0)
    assert controller.capped(longest=1000, max_per_micro_batch=8000).micro_batch_size == 8
    assert controller.capped(longest=3000, max_per_micro_batch=8000).micro_batch_size == 2
    assert controller.capped(longest=9000, max_per_micro_batch=8000).micro_batch_size == 1
    change = controller.on_oom("forward", tried=controller.capped(longest=3000, max_per_micro_batch=8000))  # the capped plan failed: halve it
    assert (change.old.micro_batch_size, change.new.micro_batch_size) == (2, 1)

    ids = {c: i for i, c in enumerate(["<pad>", "<unk>", "|", "'"] + list("abcdefghijklmnopqrstuvwxyz"))}
    frames = ["<pad>", "a", "a", "<pad>", "a", "|", "b", "b", "<pad>", "c"]
    log_probs = torch.full((1, len(frames) + 2, 40), -9.0)
    for t, c in enumerate(frames + ["z", "z"]):
        log_probs[0, t, ids[c]] = 0.0
    ctc = CTC.__new__(CTC)
    ctc.blank = 0
    assert ctc.decode(log_probs, torch.tensor([len(frames)])) == ["aa bc"]  # the two trailing frames are padding


# --- training on 2 ranks ----------------------------------------------------------------------

SPEECH_ENGINES = ["ddp", "ddp_reducer", "fsdp", "zero2"]


@pytest.fixture(scope="module")
def speech_runs(tmp_path_factory, speech_cache):
    runs = {}
    for name in SPEECH_ENGINES:
        args = ENGINES[name]
        out = tmp_path_factory.mktemp(f"speech_{name}")
        proc = launch(speech_args(out, speech_cache, *args), timeout=420)
        runs[name] = (read_metrics(out), proc.stdout + proc.stderr, out)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("engine", SPEECH_ENGINES)
def test_layerdrop_trains_on_every_engine_without_settings(speech_runs, engine):
    records, log, out = speech_runs[engine]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert any(r["layers_dropped"] for r in records), "no step dropped a layer"
    assert any(not r["layers_dropped"] for r in records)
    ddp = speech_runs["ddp"][0]
    first_drop = next(r["step"] for r in ddp if r["layers_dropped"])
    for r, ref in zip(records, ddp):  # every engine drops the same layers and computes the same step
        assert r["layers_dropped"] == ref["layers_dropped"] and r["batch_fingerprint"] == ref["batch_fingerprint"]
        # ZeRO's flat optimizer partitions step a dropped layer with a zero gradient (its Adam
        # moments decay); DDP and FSDP2 leave it out of the step: equal until the step after a drop
        exact = engine != "zero2" or r["step"] <= first_drop
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-4 if exact else 1e-2)
    assert 0.0 <= records[-1]["val_wer"] and 0.0 <= records[-1]["val_cer"]
    assert "val_wer" in records[3] and records[-1]["loss"] < records[0]["loss"]
    if engine == "ddp_reducer":
        assert "find_unused_parameters=True" in log
    if engine == "ddp":  # the export loads with transformers' own classes
        from transformers import AutoModelForCTC, Wav2Vec2Processor

        processor = Wav2Vec2Processor.from_pretrained(out / "model")
        model = AutoModelForCTC.from_pretrained(out / "model")
        assert len(processor.tokenizer) == model.config.vocab_size
        assert model.config.layerdrop == pytest.approx(0.1)  # the recipe's value, not memtrain's 0
        assert processor.tokenizer.decode([9, 9, 0, 9, 2, 10]) == "ff g"  # CTC-collapsing decode of our ids (f f _ f | g)


@pytest.mark.slow
def test_oom_on_long_utterances_shrinks_and_keeps_the_batches(speech_runs, speech_cache, tmp_path):
    """Injected OOMs whenever a micro-batch holds more encoder frames than the longest single
    utterances need: the plan shrinks, the same samples are retried, and the losses match."""
    ddp = speech_runs["ddp"][0]
    launch(speech_args(tmp_path, speech_cache, "--backend.name", "ddp", "--faults.oom_above_tokens", "300",
                       "--memory.grow_back_window", "0"), timeout=420)
    records = read_metrics(tmp_path)
    events = [e for r in records for e in r.get("plan_changes", []) if e["event"] == "oom_shrink"]
    assert events and records[-1]["micro_batch_size"] < 4
    assert [r["batch_fingerprint"] for r in records] == [r["batch_fingerprint"] for r in ddp]
    for r, ref in zip(records, ddp):
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-4)
        assert r["layers_dropped"] == ref["layers_dropped"]


@pytest.mark.slow
def test_frame_cap_splits_long_batches_only(speech_runs, speech_cache, tmp_path):
    from memtrain.config import parse_args
    from memtrain.data import GlobalBatchSampler, build_corpus

    corpus = build_corpus(parse_args(SPEECH_ARGS + ["--data.cache_dir", speech_cache]).data)
    sampler = GlobalBatchSampler(len(corpus.train), 8, 1234, lengths=corpus.train.lengths, bucket_batches=2)
    longest = [int(corpus.train.lengths[sampler.global_batch(sampler.cursor(s))].max()) for s in range(STEPS)]
    cap = 4 * int(np.median(longest))
    launch(speech_args(tmp_path, speech_cache, "--backend.name", "ddp",
                       "--data.speech.max_audio_samples_per_micro_batch", str(cap)), timeout=420)
    records, ddp = read_metrics(tmp_path), speech_runs["ddp"][0]
    micro = [r["micro_batch_size"] for r in records]
    assert micro == [4 if 4 * n <= cap else 2 if 2 * n <= cap else 1 for n in longest]
    assert min(micro) < 4 < max(micro) + 1
    for r, ref in zip(records, ddp):
        assert r["batch_fingerprint"] == ref["batch_fingerprint"]
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-4)


@pytest.mark.slow
def test_killed_and_resumed_speech_run_is_bitwise_identical(speech_cache, tmp_path):
    """Bucketed batches, the LayerDrop decisions and SpecAugment's NumPy-drawn masks all resume
    exactly: killed after step 5, resumed from step 3's checkpoint, steps 4-8 are identical."""
    args = ["--backend.name", "ddp", "--model.config.mask_time_prob", "0.05", "--model.config.mask_time_length", "4",
            "--checkpoint.every_steps", "3"]
    launch(speech_args(tmp_path / "continuous", speech_cache, *args), timeout=420)
    base = read_metrics(tmp_path / "continuous")
    killed = launch(speech_args(tmp_path / "killed", speech_cache, *args, "--faults.kill_at_step", "5"),
                    timeout=420, check=False)
    assert killed.returncode != 0
    launch(speech_args(tmp_path / "killed", speech_cache, *args), timeout=420)
    records = read_metrics(tmp_path / "killed")
    assert records[3]["event"].startswith("resume") and [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r, ref in zip(records, base):
        for key in ("loss", "grad_norm", "batch_fingerprint", "layers_dropped", "micro_batch_size"):
            assert r[key] == ref[key], (r["step"], key)
