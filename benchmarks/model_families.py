"""Model families at sizes drawn from a seed: transformers configs small enough for a 2-rank CPU run.

The accounting was first fitted on GPT-2-shaped models, then developed on Llama, Mistral, Qwen2
and GPT-NeoX at seed 0's sizes; they differ where memory does: grouped-query attention (Llama), a
sliding-window mask (Mistral), attention biases and untied embeddings (Qwen2), partial rotary
embeddings and a parallel residual (GPT-NeoX). Two mixture-of-experts families were added after
it, never used to develop it: Mixtral (top-2 of 4 or 8 experts in every block) and Qwen2-MoE
(routed experts beside a gated shared expert), transformers' fused expert weights.

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


FAMILIES = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "gpt_neox": gpt_neox, "gpt2": gpt2,
            "mixtral": mixtral, "qwen2_moe": qwen2_moe}
"""model_type → its draw: ``draw(random.Random) -> model.config dict``."""


def draw(model_type: str, seed: int) -> dict:
    """The ``model.config`` dict of ``model_type`` drawn with ``seed`` (the same seed, the same model).

    Raises:
        KeyError: ``model_type`` is not one of :data:`FAMILIES`.
    """
    config = FAMILIES[model_type](random.Random(f"{model_type}:{seed}"))
    positions = "n_positions" if "n_positions" in config else "max_position_embeddings"
    return {**config, positions: _seq_len(model_type, seed)}


def model_args(config: dict) -> list[str]:
    """memtrain arguments that build ``config`` on samples of as many tokens as it has positions."""
    tokens = config.get("n_positions", config.get("max_position_embeddings"))
    return ["--model.config", json.dumps(config), "--data.seq_len", str(tokens)]
