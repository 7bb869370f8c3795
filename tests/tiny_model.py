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


# Like Qwen3's template: earlier assistant turns lose their <think> block when replayed.
REASONING_CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{{ message['content'].split('</think>')[-1].lstrip('\n') }}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINK = ["<think>", "</think>"]


def write_tokenizer(out: Path, specials: list[str] = SPECIALS, template: str = CHATML, words: tuple[str, ...] = (),
                    config: dict | None = None) -> int:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(specials + sorted(alphabet))}
    # A few merges so that multi-byte pieces and word pieces exist.
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ã", "©")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    # Whole phrases as single ordinary tokens: a script can then say text with repeats.
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": template,
                **(config or {}),
            }
        )
    )
    return tok.get_vocab_size()  # added tokens included


def _token_id(out: Path, text: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(text)


def _config(vocab_size: int, context: int) -> dict:
    return {
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


def build_tiny_model(out: Path, *, seed: int = 7, context: int = 32768, head_dim: int | None = None) -> Path:
    """`head_dim`: wider heads than the default 16 (a quantized KV cache needs 32 or more)."""
    from mlx_lm.models import llama

    out.mkdir(parents=True, exist_ok=True)
    config = _config(write_tokenizer(out), context)
    if head_dim:
        config["head_dim"] = head_dim
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


# What the scripted model says after any "\n" (byte-level "Ċ", so right after "<|im_start|>assistant\n"):
# hidden reasoning " the", then "OK". " the" is sampled as three tokens (Ġt, h, e) where a
# fresh tokenization has one (Ġthe): the BPE boundary case.
SCRIPT = ["Ċ", "<think>", "Ġt", "h", "e", "</think>", "O", "K", "<|im_end|>"]
SCRIPTED_REPLY = "<think> the</think>OK"


# A reasoning turn that calls two tools: each call's text is one added token.
CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
)
TOOL_SCRIPT = ["Ċ", "<think>", "Ġt", "h", "e", "</think>", *CALLS, "<|im_end|>"]

# A template whose generation prompt says how many tool results the conversation holds, by
# the byte it ends with ("\n", "\t", then " "; not "\r", which Jinja reads as a newline): a
# scripted model can then call a tool, call another after the first result, and answer
# after the second (an agent's loop).
# Earlier turns render with "\n" and without their reasoning, as REASONING_CHATML.
STEPPED_CHATML = (
    "{% set ns = namespace(results=0) %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'].startswith('<tool_response>') %}{% set ns.results = ns.results + 1 %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'].split('</think>')[-1].lstrip('\n') }}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ ['\n', '\t', ' '][[ns.results, 2] | min] }}{% endif %}"
)


def build_scripted_model(out: Path, *, script: list[str | None] = SCRIPT, words: tuple[str, ...] = (), seed: int = 11,
                         context: int = 32768, tokenizer_config: dict | None = None,
                         template: str = REASONING_CHATML) -> Path:
    """A tiny llama whose greedy output is `script`, whatever came before (a None in it
    starts another chain: the token after it follows no other).

    Its layers add nothing to the residual stream (zero output projections), so the last
    token alone picks the next one: each token's embedding has a constant first feature
    (a baseline that makes <|im_end|> the default) and the output head maps each SCRIPT
    token's embedding to its successor. The attention layers still compute and cache K/V,
    so every KV path runs as with any model."""
    from mlx_lm.models import llama
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = _config(write_tokenizer(out, SPECIALS + THINK, template, words, tokenizer_config), context)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab()
    emb = mx.random.normal(model.model.embed_tokens.weight.shape)
    emb[:, 0] = 3.0
    model.model.embed_tokens.weight = emb
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    head = mx.zeros(model.lm_head.weight.shape)
    head[vocab["<|im_end|>"], 0] = 1.0
    for a, b in zip(script, script[1:]):
        if a is None or b is None:  # None breaks the script into chains
            continue
        e = emb[vocab[a]] * (mx.arange(emb.shape[1]) > 0)
        head[vocab[b]] += 4.0 * e / mx.sqrt((e * e).sum())
    model.lm_head.weight = head
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    return out


def build_tiny_moe_model(out: Path, arch: str, *, bits: int = 4, group_size: int = 32, seed: int = 5) -> Path:
    """A tiny random mixture-of-experts model of an mlx-lm architecture (`qwen3_moe`, or
    `deepseek_v3` / `deepseek_v2`: MLA attention, a shared expert, a dense first layer), 8 experts, top 2,
    affine-quantized like a converted checkpoint (`quantization` in its config)."""
    import importlib

    import mlx.nn as nn

    out.mkdir(parents=True, exist_ok=True)
    common = {
        "model_type": arch, "vocab_size": write_tokenizer(out), "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "norm_topk_prob": True, "eos_token_id": 2,
    }
    if arch == "qwen3_moe":
        config = {**common, "num_experts": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "num_key_value_heads": 2, "head_dim": 64}
    elif arch == "deepseek_v3":
        config = {**common, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
                  "routed_scaling_factor": 1.0, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 32,
                  "v_head_dim": 32, "qk_nope_head_dim": 32, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                  "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1}
    elif arch == "deepseek_v2":  # its attention keeps full K and V in the cache, so --kv-bits takes it
        config = {**common, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
                  "routed_scaling_factor": 1.0, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 32,
                  "v_head_dim": 64, "qk_nope_head_dim": 32, "topk_method": "greedy", "first_k_dense_replace": 1,
                  "moe_layer_freq": 1, "rope_scaling": {"type": "yarn", "factor": 1.0, "beta_fast": 32,
                                                        "beta_slow": 1, "original_max_position_embeddings": 4096}}
    else:
        raise ValueError(arch)
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.lm_head.weight = mx.random.normal(model.lm_head.weight.shape) * 2.0  # decisive greedy choices
    nn.quantize(model, group_size=group_size, bits=bits)
    config["quantization"] = {"group_size": group_size, "bits": bits}
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    return out


def build_tiny_gguf(model_dir: Path, out: Path, arch: str = "llama", drop: str | None = None) -> Path:
    """`model_dir` (a tiny llama of build_tiny_model) as llama.cpp writes a float32 GGUF: its
    tensor names, its rotary row order for attn_q/attn_k, its vocab and merges as metadata.
    `arch`: the architecture it claims (an unknown one must be refused); `drop`: a tensor
    left out (the file converts, but its model cannot load)."""
    from lmsp_mlx.engine.gguf import _LAYER_NAMES, _TOP_NAMES

    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    layer = {v: k for k, v in _LAYER_NAMES.items()}
    top = {v: k for k, v in _TOP_NAMES.items()}

    def permute(w: mx.array, heads: int) -> mx.array:  # llama.cpp's convert_hf_to_gguf.py `permute`
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    tensors = {}
    for name, w in mx.load(str(model_dir / "model.safetensors")).items():
        base, _, suffix = name.rpartition(".")
        if base.startswith("model.layers."):
            _, _, i, part = base.split(".", 3)
            gguf = f"blk.{i}.{layer[part]}.{suffix}"
        else:
            gguf = f"{top[base]}.{suffix}"
        if ".attn_q." in gguf:
            w = permute(w, config["num_attention_heads"])
        elif ".attn_k." in gguf:
            w = permute(w, config["num_key_value_heads"])
        tensors[gguf] = w
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": arch, "general.file_type": u32(0),
        "llama.embedding_length": u32(config["hidden_size"]), "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        "llama.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        "llama.context_length": u32(config["max_position_embeddings"]), "llama.vocab_size": u32(len(tokens)),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in special else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(vocab["<|endoftext|>"]), "tokenizer.ggml.eos_token_id": u32(vocab["<|im_end|>"]),
        "tokenizer.chat_template": CHATML,
    }
    if drop is not None:
        del tensors[drop]
    mx.save_gguf(str(out), tensors, meta)
    return out


# Per-architecture overrides of _FAMILY_BASE: 4 layers of width 64, heads of 16, in which
# each family's cache kinds mix (see build_tiny_family_model).
_LINEAR = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
_FAMILY_CONFIGS: dict[str, dict] = {
    "llama": {},
    "qwen3_next": {**_LINEAR, **_MOE, "decoder_sparse_step": 1, "mlp_only_layers": [],
                   "shared_expert_intermediate_size": 32, "partial_rotary_factor": 0.5},
    "qwen3_5": {**_LINEAR, "rope_parameters": {"type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5}},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "gemma3_text": {"sliding_window": 16, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16,
                    "rope_local_base_freq": 10000.0},
    "nemotron_h": {"hybrid_override_pattern": ["M", "*", "-", "M"], "mamba_num_heads": 4, "mamba_head_dim": 16,
                   "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "mamba_proj_bias": False,
                   "use_bias": False, "use_conv_bias": True, "mlp_bias": False, "attention_bias": False,
                   "layer_norm_epsilon": 1e-5},
    "kimi_linear": {**_MOE, "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
                    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
                    "mla_use_nope": True, "model_max_length": 4096,
                    "bos_token_id": 0, "pad_token_id": 0,  # transformers' defaults lie outside the vocab
                    "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4,
                                           "head_dim": 16, "short_conv_kernel_size": 4}},
    "deepseek_v3": {"num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "routed_scaling_factor": 1.0,
                    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "v_head_dim": 16,
                    "qk_nope_head_dim": 16, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 1,
                    "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True},
}
_FAMILY_BASE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": 2,
}
FAMILIES = tuple(_FAMILY_CONFIGS)


def build_tiny_family_model(out: Path, arch: str, *, seed: int = 3, **sizes) -> Path:
    """A tiny random float32 model of an mlx-lm architecture in FAMILIES, 4 layers of width
    64, whose per-layer caches (make_prompt_cache) mix kinds: `llama` all KVCache;
    `qwen3_next` (MoE) and `qwen3_5` (dense, its text model alone) linear-attention layers
    (ArraysCache) between full ones (KVCache); `gpt_oss` and `gemma3_text` sliding-window
    layers (RotatingKVCache, window 16) between full ones (KVCache); `nemotron_h` Mamba layers
    (ArraysCache) and an attention layer (KVCache), its MLP layer having no cache (so 3 caches
    for 4 layers); `kimi_linear` delta-attention layers (ArraysCache of 4) between MLA ones
    (KVCache); `deepseek_v3` MLA layers (KVCache), the first dense, the rest MoE.
    `sizes` override the config's sizes (benchmarks/architectures.py builds wider ones)."""
    import importlib

    out.mkdir(parents=True, exist_ok=True)
    config = {"model_type": arch, "vocab_size": write_tokenizer(out), **_FAMILY_BASE, **_FAMILY_CONFIGS[arch], **sizes}
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    head = getattr(model, "language_model", model).lm_head  # qwen3_5 wraps its text model
    head.weight = mx.random.normal(head.weight.shape) * 2.0  # decisive greedy choices
    weights = dict(tree_flatten(model.parameters()))
    assert all(w.dtype == mx.float32 for w in weights.values()), arch
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config))
    return out


def first_layers(src: Path, out: Path, layers: int) -> Path:
    """A copy of the model at `src` (config.json and *.safetensors, mlx-lm's names) that keeps
    only its first `layers` decoder layers: a draft model with the same tokenizer, cheaper and
    less often right. Files other than weights and config are copied as they are."""
    import shutil

    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    for f in out.glob("*.safetensors"):
        weights = mx.load(str(f))
        mx.save_safetensors(str(f), {k: v for k, v in weights.items()
                                     if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= layers)})
    return out
