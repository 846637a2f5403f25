"""Model families at new sizes (the families the accounting was developed on): transformers
configs of each family at sizes drawn from a seed, small enough for a 2-rank CPU run.

The accounting was first fitted on GPT-2-shaped models, then developed on these families at seed
0's sizes; they differ where memory does: grouped-query attention (Llama), a sliding-window mask (Mistral), attention biases and
untied embeddings (Qwen2), partial rotary embeddings and a parallel residual (GPT-NeoX).
Each draw is a ``model.config`` dict for ``memtrain --model.config '<json>'``.
"""

from __future__ import annotations

import json
import random

SEQ_LEN = 64
"""Tokens per sample of every drawn model (its positions are exactly this many)."""


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


def gpt2(rng: random.Random) -> dict:
    """GPT-2 (the family the accounting was fitted on), at drawn sizes."""
    hidden, heads, layers, _ = _widths(rng)
    return {"model_type": "gpt2", "n_embd": hidden, "n_head": heads, "n_layer": layers, "n_positions": SEQ_LEN,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


FAMILIES = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "gpt_neox": gpt_neox, "gpt2": gpt2}
"""model_type → its draw: ``draw(random.Random) -> model.config dict``."""


def draw(model_type: str, seed: int) -> dict:
    """The ``model.config`` dict of ``model_type`` drawn with ``seed`` (the same seed, the same model).

    Raises:
        KeyError: ``model_type`` is not one of :data:`FAMILIES`.
    """
    return FAMILIES[model_type](random.Random(f"{model_type}:{seed}"))


def model_args(config: dict) -> list[str]:
    """memtrain arguments that build ``config`` on samples of :data:`SEQ_LEN` tokens."""
    return ["--model.config", json.dumps(config), "--data.seq_len", str(SEQ_LEN)]
