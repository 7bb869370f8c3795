"""A Claude Code-shaped loop on /v1/messages: the billing line left out, against it rendered.

    python -m benchmarks.claude_code_loop [--turns 10] [--system-tokens 15000] [--tool 60] [--out DIR] [--append]

What Claude Code sends every turn: a long system prompt and tool list (here ~15k tokens of
generated text and five tools), `x-anthropic-billing-header: cc_version=...; cch=<nonce>;`
first in `system` with a new nonce each turn, `thinking: {"type": "adaptive", "display":
"omitted"}`, and the whole history, thinking blocks (with their signatures) included. The
model is the agent loop's synthetic one (benchmarks/scripted_model.py), SmolLM2-135M's
shapes with weights that make greedy decoding reason a few words and then call a tool,
every turn; its context is raised to 32k (the weights run at any length), as Claude Code
needs.

The same loop runs against two servers, one after the other: this one as it is, and with
`--keep-billing-header`, which renders the line as the peers do (mlx_lm.server has no
/v1/messages; LM Studio and Ollama render the system prompt whole). Reports per turn the
prefilled tokens (input_tokens: Anthropic's count without the cached part) and the time to
first token (the first content block, from the client's side). Writes
benchmarks/results/claude_code_loop.csv (with the run's provenance columns; `--append` adds
to its history) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
from benchmarks.common import (  # noqa: E402
    Provenance, output_arguments, own_state, server_command, serving, sse_events, write_rows,
)
from benchmarks.scripted_model import build_model  # noqa: E402
from lmsp_mlx.engine.model_store import DEFAULT_MODEL, default_models_dir, ensure_packaged_model  # noqa: E402

CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "pytest -q", "description": "Run the tests"}}\n</tool_call>'
WORDS = ("file", "test", "change", "command", "user", "tool", "read", "write", "always", "never", "before",
         "after", "the", "a", "of", "to", "when", "output", "result", "error", "path", "line", "code", "run")


def prose(words: int, seed: int) -> str:
    """Instruction-like text, the same for the same seed."""
    rng = random.Random(seed)
    sentences = []
    while words > 0:
        n = min(words, rng.randint(8, 20))
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
        words -= n
    return " ".join(sentences)


def tools(words: int) -> list[dict]:
    names = ("Bash", "Read", "Edit", "Write", "Grep")
    return [{"name": name, "description": prose(words // len(names), i),
             "input_schema": {"type": "object", "properties": {"command": {"type": "string"},
                                                                "description": {"type": "string"}},
                              "required": ["command"]}} for i, name in enumerate(names)]


def turn(client: httpx.Client, body: dict) -> tuple[float, dict, dict]:
    """One streamed turn: time to its first content block, the reply's blocks and its usage."""
    began, first, blocks, usage = time.perf_counter(), None, [], {}
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for name, data in sse_events(r.iter_lines()):
            if name == "content_block_start":
                first = first or time.perf_counter()
                blocks.append(data["content_block"])
            elif name == "content_block_delta":
                d, b = data["delta"], blocks[data["index"]]
                if d["type"] == "signature_delta":
                    b["signature"] = d["signature"]
                elif d["type"] == "thinking_delta":
                    b["thinking"] += d["thinking"]
                elif d["type"] == "text_delta":
                    b["text"] += d["text"]
                elif d["type"] == "input_json_delta":
                    b["partial"] = b.get("partial", "") + d["partial_json"]
            elif name == "message_delta":
                usage = data["usage"]
            elif name == "error":
                raise SystemExit(f"error event: {data}")
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.pop("partial", "{}"))
    return first - began, blocks, usage


def run_loop(name: str, url: str, turns: int, system_words: int, tool_words: int) -> list[dict]:
    system_text = prose(system_words, 100)
    offered = tools(system_words // 3)
    messages: list[dict] = [{"role": "user", "content": "The tests fail after my last change. Fix them."}]
    rows = []
    with httpx.Client(base_url=url, timeout=900) as client:
        for t in range(1, turns + 1):
            nonce = f"{random.Random(t).getrandbits(20):05x}"
            body = {"model": "claude-opus-5-5", "max_tokens": 256,
                    "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.328.{nonce[:3]}; "
                                                        f"cc_entrypoint=cli; cch={nonce};"},
                               {"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}}],
                    "tools": offered, "messages": messages, "temperature": 0,
                    "thinking": {"type": "adaptive", "display": "omitted"}}
            ttft, blocks, usage = turn(client, body)
            prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
            rows.append({"server": name, "turn": t, "ttft_s": ttft, "prompt_tokens": prompt,
                         "prefilled_tokens": usage["input_tokens"], "cached_tokens": usage["cache_read_input_tokens"]})
            print(f"{name:>22} turn {t:2d}: ttft {ttft:7.3f}s prompt {prompt:6d} prefilled {usage['input_tokens']:6d}",
                  flush=True)
            uses = [b for b in blocks if b["type"] == "tool_use"]
            if not uses:
                raise SystemExit(f"turn {t} made no tool call: {blocks}")
            messages = messages + [
                {"role": "assistant", "content": blocks},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u["id"],
                                              "content": prose(tool_words * (1 + t % 4), 200 + t)} for u in uses]}]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-tokens", type=int, default=15000, help="about this many tokens of system prompt and tools")
    p.add_argument("--tool", type=int, default=60, help="words per tool result (times 1-4, by turn)")
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()

    source = ensure_packaged_model(DEFAULT_MODEL, default_models_dir())
    model_dir = default_models_dir() / "claude-code-loop-bench"
    build_model(model_dir, source, reasoning=16, visible=0, call=CALL, context=32768)
    logs = Path(tempfile.mkdtemp(prefix="claude-code-loop-"))
    # The generated prose is ~1.1 tokens a word for this tokenizer; a third goes to the tools.
    system_words = int(args.system_tokens / 1.1 * 2 / 3)
    rows = []
    for name, extra in (("lmsp-mlx", []), ("--keep-billing-header", ["--keep-billing-header"])):
        (logs / name).mkdir()
        cmd = server_command("lmsp-mlx", "--model", model_dir, "--model-id", "bench", "--model-alias", "claude-*=bench",
                             *own_state(logs / name, kv_disk=True), *extra)
        with serving(cmd, logs / f"{name}.log") as server:
            rows += run_loop(name, server.url, args.turns, system_words, args.tool)
    print(f"server logs: {logs}", flush=True)
    write_rows("claude_code_loop", rows, provenance, out=args.out, append=args.append)

    by = {(r["server"], r["turn"]): r for r in rows}
    print("\n| turn | prompt tokens | prefilled | prefilled, billing line rendered | TTFT (s) | "
          "TTFT, billing line rendered (s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for t in range(1, args.turns + 1):
        a, b = by[("lmsp-mlx", t)], by[("--keep-billing-header", t)]
        print(f"| {t} | {a['prompt_tokens']} | {a['prefilled_tokens']} | {b['prefilled_tokens']} | "
              f"{a['ttft_s']:.2f} | {b['ttft_s']:.2f} |")
    ours = statistics.median(r["ttft_s"] for r in rows if r["server"] == "lmsp-mlx" and r["turn"] >= 2)
    theirs = statistics.median(r["ttft_s"] for r in rows if r["server"] != "lmsp-mlx" and r["turn"] >= 2)
    print(f"\nturns 2-{args.turns}: median TTFT {ours:.2f}s against {theirs:.2f}s with the line rendered "
          f"({theirs / ours:.0f}x)")


if __name__ == "__main__":
    main()
