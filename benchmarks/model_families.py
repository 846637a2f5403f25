"""Model families at sizes drawn from a seed: transformers configs small enough for a 2-rank CPU run.

The accounting was first fitted on GPT-2-shaped models, then developed on Llama, Mistral, Qwen2
and GPT-NeoX at seed 0's sizes; they differ where memory does: grouped-query attention (Llama), a
sliding-window mask (Mistral), attention biases and untied embeddings (Qwen2), partial rotary
embeddings and a parallel residual (GPT-NeoX). Two mixture-of-experts families were added after
it, never used to develop it: Mixtral (top-2 of 4 or 8 experts in every block) and Qwen2-MoE
(routed experts beside a gated shared expert), transformers' fused expert weights; and the
speech family memtrain's speech recipe trains, WavLM for CTC on raw waveforms.

Each draw is a ``model.config`` dict for ``memtrain --model.config '<json>'``; its positions are
its samples' tokens (:func:`_seq_len`): :data:`SEQ_LEN` for seeds 0 and 1 (the rows published
with them), drawn from :data:`SEQ_LENS` for later seeds.
"""

from __future__ import annotations

import json
import random

SEQ_LEN = 64
"""Tokens per sample of the models of seeds 0 and 1 (their positions are exactly this many)."""
SEQ_LENS = (32, 64, 128)
"""Tokens per sample a model of a later seed is drawn with."""


def _seq_len(model_type: str, seed: int) -> int:
    """The sequence length of ``model_type``'s draw with ``seed`` (its own random stream, so the
    sizes drawn before the sequence became an axis are unchanged)."""
    return SEQ_LEN if seed <= 1 else random.Random(f"{model_type}:{seed}:seq_len").choice(SEQ_LENS)


def _widths(rng: random.Random) -> tuple[int, int, int, int]:
    """(hidden size, attention heads, layers, MLP width) drawn from ``rng``: hidden 64–192 in
    steps of 32, heads 2–8 of at least 16 dimensions, 2–4 layers, MLP 2–4× hidden (a multiple of 8)."""
    hidden = rng.choice([64, 96, 128, 160, 192])
    heads = rng.choice([h for h in (2, 4, 8) if hidden % h == 0 and hidden // h >= 16])
    mlp = int(hidden * rng.choice([2.0, 2.5, 8 / 3, 3.5, 4.0])) // 8 * 8
    return hidden, heads, rng.randint(2, 4), mlp


def _llama_like(model_type: str, rng: random.Random) -> dict:
    hidden, heads, layers, mlp = _widths(rng)
    kv = rng.choice([k for k in (1, 2, heads) if heads % k == 0])  # grouped-query attention
    return {"model_type": model_type, "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": kv, "num_hidden_layers": layers, "intermediate_size": mlp,
            "max_position_embeddings": SEQ_LEN, "tie_word_embeddings": rng.random() < 0.5}


def llama(rng: random.Random) -> dict:
    """Llama: grouped-query attention (1, 2 or all heads' keys and values), RMSNorm, SwiGLU."""
    return _llama_like("llama", rng)


def mistral(rng: random.Random) -> dict:
    """Mistral: Llama's blocks with a sliding attention window shorter than the sequence."""
    return {**_llama_like("mistral", rng), "sliding_window": rng.choice([SEQ_LEN // 4, SEQ_LEN // 2])}


def qwen2(rng: random.Random) -> dict:
    """Qwen2: Llama's blocks with biases on the query, key and value projections."""
    return {**_llama_like("qwen2", rng), "use_sliding_window": False}


def gpt_neox(rng: random.Random) -> dict:
    """GPT-NeoX: LayerNorm, GELU MLP, rotary embeddings on a quarter or half of each head,
    parallel or sequential residual."""
    hidden, heads, layers, mlp = _widths(rng)
    return {"model_type": "gpt_neox", "hidden_size": hidden, "num_attention_heads": heads,
            "num_hidden_layers": layers, "intermediate_size": mlp, "max_position_embeddings": SEQ_LEN,
            "rotary_pct": rng.choice([0.25, 0.5]), "use_parallel_residual": rng.random() < 0.5,
            "hidden_dropout": 0.0, "attention_dropout": 0.0, "tie_word_embeddings": False}


def mixtral(rng: random.Random) -> dict:
    """Mixtral: Llama's attention; every block's MLP is top-2 of 4 or 8 SwiGLU experts (fused
    weights) chosen by a router."""
    return {**_llama_like("mixtral", rng), "num_local_experts": rng.choice([4, 8]), "num_experts_per_tok": 2,
            "sliding_window": None}


def qwen2_moe(rng: random.Random) -> dict:
    """Qwen2-MoE: Qwen2's attention; every block's MLP is top-2 of 4 or 8 small routed experts
    beside a shared expert scaled by its own gate."""
    config = _llama_like("qwen2_moe", rng)
    hidden = config["hidden_size"]
    return {**config, "num_experts": rng.choice([4, 8]), "num_experts_per_tok": 2,
            "moe_intermediate_size": hidden // 8 * rng.choice([4, 8]), "shared_expert_intermediate_size": config[
                "intermediate_size"], "use_sliding_window": False}


def gpt2(rng: random.Random) -> dict:
    """GPT-2 (the family the accounting was fitted on), at drawn sizes."""
    hidden, heads, layers, _ = _widths(rng)
    return {"model_type": "gpt2", "n_embd": hidden, "n_head": heads, "n_layer": layers, "n_positions": SEQ_LEN,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


MAX_WORDS = 8
"""Words per utterance at most of the speech models of seeds 0 and 1 (the speech recipe's)."""
MAX_WORDS_CHOICES = (5, 8, 12)
"""Words per utterance at most a speech model of a later seed is drawn with (its audio's length)."""


def wavlm(rng: random.Random) -> dict:
    """WavLM for CTC (the speech recipe's model, :file:`recipes/asr_ctc_wavlm_tiny.yaml`): a 7-layer
    convolutional feature encoder over the raw 16 kHz waveform, a convolutional position embedding,
    transformer blocks with gated relative position bias; LayerDrop off (every block runs, as the
    plan assumes). Its length axis is the utterances' words (``max_words``, read by
    :func:`model_args`, not a model setting)."""
    hidden, _, layers, _ = _widths(rng)
    hidden = min(hidden, 128)
    heads = rng.choice([h for h in (2, 4) if hidden % h == 0])
    return {"model_type": "wavlm", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "intermediate_size": 2 * hidden * rng.choice([1, 2]), "conv_dim": [rng.choice([32, 64])] * 7,
            "feat_extract_norm": "layer", "do_stable_layer_norm": True,
            "num_conv_pos_embeddings": rng.choice([16, 32]), "num_conv_pos_embedding_groups": 8 if hidden % 8 == 0 else 4,
            "num_buckets": 64, "max_bucket_distance": 200, "hidden_dropout": 0.0, "attention_dropout": 0.0,
            "activation_dropout": 0.0, "feat_proj_dropout": 0.0, "final_dropout": 0.0, "mask_time_prob": 0.05,
            "layerdrop": 0.0}


SPEECH = ("wavlm",)
"""The families trained on speech (CTC over characters) rather than tokens."""

FAMILIES = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "gpt_neox": gpt_neox, "gpt2": gpt2,
            "mixtral": mixtral, "qwen2_moe": qwen2_moe, "wavlm": wavlm}
"""model_type → its draw: ``draw(random.Random) -> model.config dict``."""


def draw(model_type: str, seed: int) -> dict:
    """The ``model.config`` dict of ``model_type`` drawn with ``seed`` (the same seed, the same model).

    Raises:
        KeyError: ``model_type`` is not one of :data:`FAMILIES`.
    """
    config = FAMILIES[model_type](random.Random(f"{model_type}:{seed}"))
    if model_type in SPEECH:
        words = MAX_WORDS if seed <= 1 else random.Random(f"{model_type}:{seed}:max_words").choice(MAX_WORDS_CHOICES)
        return {**config, "max_words": words}
    positions = "n_positions" if "n_positions" in config else "max_position_embeddings"
    return {**config, positions: _seq_len(model_type, seed)}


def model_args(config: dict) -> list[str]:
    """memtrain arguments that build ``config`` on samples of as many tokens as it has positions,
    or, for a speech model, on utterances of at most ``config["max_words"]`` words."""
    if "max_words" in config:
        model = {k: v for k, v in config.items() if k != "max_words"}
        return ["--model.config", json.dumps(model), "--data.speech.max_words", str(config["max_words"])]
    tokens = config.get("n_positions", config.get("max_position_embeddings"))
    return ["--model.config", json.dumps(config), "--data.seq_len", str(tokens)]
