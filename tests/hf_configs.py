"""Tiny transformers configs of five families, written as config.json files (no download)."""

import json
from pathlib import Path

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=16)
CONFIGS = {
    "llama": {**TINY, "model_type": "llama", "tie_word_embeddings": False},
    "mistral": {**TINY, "model_type": "mistral", "sliding_window": 8},  # narrower than the sequence
    "qwen2": {**TINY, "model_type": "qwen2"},
    "qwen3": {**TINY, "model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},  # q/k norms
    "gemma2": {**TINY, "model_type": "gemma2", "head_dim": 16, "sliding_window": 8,  # softcaps, tied
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "vocab_size": 128, "n_positions": 16,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0},
}


PARITY_FAMILIES = ("llama", "mistral", "qwen3", "gemma2", "gpt2")  # five families, four plans each


def write_configs(folder: Path) -> dict[str, str]:
    """family -> ``hf:`` reference of its tiny config (a directory holding config.json)."""
    refs = {}
    for family, config in CONFIGS.items():
        (folder / family).mkdir(parents=True, exist_ok=True)
        (folder / family / "config.json").write_text(json.dumps(config))
        refs[family] = f"hf:{folder / family}"
    return refs
