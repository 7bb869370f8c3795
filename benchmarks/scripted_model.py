"""The synthetic model of the agent-loop benchmarks (agent_loop, claude_code_loop): SmolLM2-135M's
exact shapes, so every matmul costs what it costs in the real model, with weights that make
greedy decoding follow a fixed script (`<think>`, reasoning words, `</think>`, visible words,
optionally a tool call), behind a chat template that drops the reasoning from the history
(like Qwen3's and DeepSeek's). The weights run at any context length.
"""

from __future__ import annotations

import json
from pathlib import Path

REASONING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{{ message['content'].split('</think>')[-1].lstrip('\n') }}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def word_tokens(vocab: dict[str, int], count: int, skip: set[int]) -> list[int]:
    """`count` distinct tokens that are whole lowercase words with a leading space."""
    words = sorted(i for t, i in vocab.items() if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower()
                   and len(t) > 3 and i not in skip)
    if len(words) < count:
        raise SystemExit(f"the vocabulary has only {len(words)} word tokens")
    step = len(words) // count
    return words[::step][:count]


def build_model(out: Path, source: Path, reasoning: int, visible: int, call: str | None = None,
                context: int | None = None) -> list[int]:
    """Write the synthetic model; returns its scripted reply as token ids. `call`: the reply
    ends with this text (a tool call), one added token; `context`: its context length
    (the synthetic weights run at any length)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import AddedToken, Tokenizer

    marker = out / "bench.json"
    spec = {"source": str(source), "reasoning": reasoning, "visible": visible, "call": call, "context": context,
            "version": 1}
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    vocab = tok.get_vocab()
    if marker.exists() and json.loads(marker.read_text()).get("spec") == spec:
        return json.loads(marker.read_text())["script"]
    out.mkdir(parents=True, exist_ok=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<think>", "</think>")])
    if call:
        tok.add_tokens([AddedToken(call, special=False, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab()
    tok_config = json.loads((source / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = REASONING_TEMPLATE
    tok_config.pop("added_tokens_decoder", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config.update(vocab_size=len(vocab), tie_word_embeddings=False, torch_dtype="float32")
    if context:
        config["max_position_embeddings"] = context
    (out / "config.json").write_text(json.dumps(config))

    newline, eos = vocab["Ċ"], vocab["<|im_end|>"]
    specials = {newline, eos, vocab["<think>"], vocab["</think>"]}
    words = word_tokens(vocab, reasoning + visible, specials)
    script = [newline, vocab["<think>"], *words[:reasoning], vocab["</think>"], *words[reasoning:],
              *([vocab[call]] if call else []), eos]
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    emb = mx.random.normal(model.model.embed_tokens.weight.shape)
    emb[:, 0] = 3.0  # a constant feature: the end-of-turn baseline
    model.model.embed_tokens.weight = emb
    for layer in model.model.layers:  # same matmuls, no effect on the residual stream
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    head = mx.zeros(model.lm_head.weight.shape)
    head[eos, 0] = 1.0
    for a, b in zip(script, script[1:]):
        e = emb[a] * (mx.arange(emb.shape[1]) > 0)
        head[b] += 4.0 * e / mx.sqrt((e * e).sum())
    model.lm_head.weight = head
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    reply = script[1:-1]
    marker.write_text(json.dumps({"spec": spec, "script": reply}))
    return reply
