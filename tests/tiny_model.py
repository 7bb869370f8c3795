"""A tiny randomly initialised llama, written as a real mlx-lm model directory.

Fast protocol tests run the real server on it: real tokenizer files (byte-level BPE with
a ChatML template), real weights, real MLX forward passes, just 2 layers of width 64.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Greedy decoding of the tiny model: FINISHES ends its turn after 3 tokens (the output head
# makes end-of-turn win right after "Q"); ENDLESS runs for thousands of tokens.
FINISHES = "Hello there"
ENDLESS = "Count these tokens, the whole prompt"
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(out: Path) -> int:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(alphabet))}
    # A few merges so that multi-byte pieces and word pieces exist.
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ã", "©")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
            }
        )
    )
    return len(vocab)


def _token_id(out: Path, text: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(text)


def build_tiny_model(out: Path, *, seed: int = 7, context: int = 32768) -> Path:
    from mlx_lm.models import llama

    out.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(out)
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "max_position_embeddings": context,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Large output weights make the random logits decisive, so greedy decoding is stable.
    head = mx.random.normal(model.lm_head.weight.shape) * 2.0
    q = model.model.embed_tokens.weight[_token_id(out, "Q")]
    head[2] = 2.0 * q / mx.sqrt((q * q).mean())  # <|im_end|> follows "Q"
    model.lm_head.weight = head
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    return out
