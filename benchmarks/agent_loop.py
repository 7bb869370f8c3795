"""An agent loop with hidden reasoning: lmsp-mlx against mlx_lm.server, one run.

    python -m benchmarks.agent_loop [--turns 10] [--reasoning 32] [--visible 256] [--tool 12] [--loops 2]
                                    [--restore-tokens 4000] [--out DIR] [--append]
    python -m benchmarks.agent_loop --suffix-turns [--out DIR] [--append]

The workload is what agent clients send: a system prompt with tool descriptions, then
turns of (the model's reply: hidden reasoning, then a long visible tool call) and (a short
tool result), the whole visible history replayed every turn, the reasoning dropped by the
chat template (like Qwen3's and DeepSeek's). To make the replies long, identical on both
servers and reasoning-shaped, the model is synthetic (benchmarks/scripted_model.py):
SmolLM2-135M's exact shapes (so every matmul costs what it costs in the real model) with
weights that make greedy decoding follow a fixed script: `<think>`, `--reasoning` words,
`</think>`, `--visible` words.

Both servers get the same CPU math: mlx_lm.server is started through a wrapper that routes
MLX's matmuls to OpenBLAS and installs lmsp-mlx's fused prefill kernels and compiled
decode step into its model, so the comparison measures what each server prefills, not
whose kernels are faster.

Tool results vary in length from turn to turn, and `--loops` agent loops run against each
server at once. `--suffix-turns` measures instead, in-process, what one turn adding 1-256
tokens to an 1,800-token session costs against the suffix's bare prefill plus one decode
step (benchmarks/results/suffix_turns.csv; target at most 1.5x).

Reports per turn: time to first token (streamed, from the client's side) and prefilled
tokens (prompt minus cached, from each server's usage). Then, in-process on the real
default model: restoring a `--restore-tokens` checkpoint from disk against prefilling it.
Writes benchmarks/results/agent_loop.csv (with the run's provenance columns; `--append`
adds to its history) and .png and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
from benchmarks.common import (  # noqa: E402
    Provenance, ServerKind, output_arguments, own_state, server_command, serving, sse_events, write_rows,
)
from benchmarks.scripted_model import build_model  # noqa: E402
from lmsp_mlx.engine.model_store import DEFAULT_MODEL, default_models_dir, ensure_packaged_model  # noqa: E402

SYSTEM = (
    "You are a coding agent. Tools: read_file(path), write_file(path, content), run(cmd), "
    "search(query). Reply with one tool call per turn as JSON. Think first. "
) * 12


# One streamed turn: (time to first token, visible text, prompt tokens, cached tokens).
Stream = Callable[[httpx.Client, list[dict], int], tuple[float, str, int, int]]


def stream_lmsp(client: httpx.Client, messages: list[dict], max_tokens: int) -> tuple[float, str, int, int]:
    body = {"model": "bench", "input": messages, "temperature": 0, "max_output_tokens": max_tokens, "stream": True}
    began, first, text, usage = time.perf_counter(), None, [], {}
    with client.stream("POST", "/v1/responses", json=body) as r:
        for _, event in sse_events(r.iter_lines()):
            if not isinstance(event, dict):
                continue
            if event["type"] in ("response.output_text.delta", "response.reasoning_summary_text.delta"):
                first = first or time.perf_counter()  # the first token, reasoning or text
            if event["type"] == "response.output_text.delta":
                text.append(event["delta"])
            elif event["type"] in ("response.completed", "response.incomplete"):
                usage = event["response"]["usage"]
    return first - began, "".join(text), usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


def stream_mlx_lm(client: httpx.Client, messages: list[dict], max_tokens: int) -> tuple[float, str, int, int]:
    body = {"model": "default_model", "messages": messages, "temperature": 0, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    began, first, text, usage = time.perf_counter(), None, [], {}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for _, chunk in sse_events(r.iter_lines()):
            if not isinstance(chunk, dict):
                continue
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content") or delta.get("reasoning"):
                    first = first or time.perf_counter()
                text.append(delta.get("content") or "")
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return first - began, "".join(text), usage["prompt_tokens"], cached


def tool_result(turn: int, words: int, loop: int = 0) -> str:
    """A tool's output; its length varies from turn to turn (real agents never send the same
    length twice): `words` give or take 90%, the same in every run."""
    count = max(1, words * (1 + (turn * 7 + loop * 3) % 19) // 10)
    return f"Tool output {loop}.{turn}: " + " ".join(f"line{turn}x{i}" for i in range(count // 2))


def run_loop(name: str, fn, url: str, turns: int, max_tokens: int, tool_words: int, loop: int = 0) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Fix the failing test in src/app{loop}.py."}]
    rows = []
    with httpx.Client(base_url=url, timeout=600) as client:
        for turn in range(1, turns + 1):
            ttft, text, prompt, cached = fn(client, messages, max_tokens)
            rows.append({"server": name, "loop": loop, "turn": turn, "ttft_s": ttft, "prompt_tokens": prompt,
                         "cached_tokens": cached, "prefilled_tokens": prompt - cached})
            print(f"{name:>14} loop {loop} turn {turn:2d}: ttft {ttft:6.3f}s prompt {prompt:5d} "
                  f"prefilled {prompt - cached:5d}", flush=True)
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": tool_result(turn, tool_words, loop)}]
    return rows


def run_loops(name: str, fn, url: str, loops: int, *args) -> list[dict]:
    """`loops` agent loops against one server at once (a coding agent and its subagent)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(loops) as pool:
        done = [pool.submit(run_loop, name, fn, url, *args, loop) for loop in range(loops)]
        return [row for d in done for row in d.result()]


def suffix_turns(session_tokens: int, lengths: list[int]) -> list[dict]:
    """In-process, on the real default model: a turn's time to its first token when it adds
    `n` tokens to a `session_tokens` session (the server's own path: a Sequence through
    the batch), against the suffix's bare prefill (`model(x, cache)` on the n tokens) plus
    one decode step. Each from a fresh copy of the session, best of three."""
    import mlx.core as mx

    from lmsp_mlx.cache.session import Session
    from lmsp_mlx.engine.batch import generate
    from lmsp_mlx.engine.generate import GenerationParams, prefill
    from lmsp_mlx.engine.loader import load_model
    from mlx_lm.models.cache import make_prompt_cache

    lm = load_model(ensure_packaged_model(DEFAULT_MODEL, default_models_dir()))
    text = "The harbour master logged each boat, its cargo and the hour of the tide. " * (session_tokens // 10)
    base = lm.tokenizer.encode(text, add_special_tokens=False)[:session_tokens]
    cache = make_prompt_cache(lm.model)
    prefill(lm, base, cache, 256, lambda done, total: None)
    session = Session(cache=cache, tokens=base)

    def best(run) -> float:
        times = []
        for _ in range(3):
            copy = session.prefix(len(base)).cache
            mx.eval([c.state for c in copy])
            began = time.perf_counter()
            run(copy)
            times.append(time.perf_counter() - began)
        return min(times)

    rows = []
    for n in lengths:
        suffix = lm.tokenizer.encode(" then the tide turned" * n, add_special_tokens=False)[:n]
        params = GenerationParams(prompt=base + suffix, max_tokens=1, temperature=0.0, cached=len(base))
        ours = best(lambda c: generate(lm, params, emit=lambda e: None, cache=c))
        bare = best(lambda c: mx.eval(lm.runner.forward(mx.array([suffix]), c)))
        step = best(lambda c: mx.eval(lm.runner.forward(mx.array([suffix[:1]]), c)))
        rows.append({"suffix_tokens": n, "ttft_s": ours, "prefill_s": bare, "step_s": step,
                     "ratio": ours / (bare + step)})
        print(f"suffix {n:4d}: first token {ours * 1000:6.0f} ms, bare prefill {bare * 1000:6.0f} ms + "
              f"one step {step * 1000:4.0f} ms: ratio {ours / (bare + step):.2f}", flush=True)
    return rows


def restore_vs_prefill(tokens: int) -> tuple[float, float]:
    """Seconds to prefill `tokens` of the real default model, and to restore them from disk."""
    import mlx.core as mx

    from lmsp_mlx.cache.disk import CheckpointStore
    from lmsp_mlx.cache.session import Session
    from lmsp_mlx.engine.generate import prefill
    from lmsp_mlx.engine.loader import load_model
    from mlx_lm.models.cache import make_prompt_cache

    lm = load_model(ensure_packaged_model(DEFAULT_MODEL, default_models_dir()))
    text = "The harbour master logged each boat, its cargo and the hour of the tide. " * (tokens // 10)
    ids = lm.tokenizer.encode(text, add_special_tokens=False)[:tokens]
    cache = make_prompt_cache(lm.model)
    began = time.perf_counter()
    prefill(lm, ids, cache, 256, lambda done, total: None)  # the server's CPU chunk size
    prefill_s = time.perf_counter() - began
    with tempfile.TemporaryDirectory() as folder:
        store = CheckpointStore(Path(folder), lm.fingerprint, 2**40)
        store.save(Session(cache=cache, tokens=ids), "token", text)
        store.flush()
        [entry] = store.entries.values()
        fresh = CheckpointStore(Path(folder), lm.fingerprint, 2**40)  # as after a restart
        began = time.perf_counter()
        session = fresh.load(fresh.entries[entry.path], text)
        mx.eval([c.state for c in session.cache])
        restore_s = time.perf_counter() - began
    return prefill_s, restore_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--reasoning", type=int, default=32, help="hidden reasoning words per reply")
    p.add_argument("--visible", type=int, default=256, help="visible tool-call words per reply")
    p.add_argument("--tool", type=int, default=12, help="words per tool result")
    p.add_argument("--restore-tokens", type=int, default=4000)
    p.add_argument("--loops", type=int, default=2, help="agent loops against each server at once")
    output_arguments(p)
    p.add_argument("--suffix-turns", action="store_true",
                   help="only the in-process per-turn measurement (suffixes of 1-256 tokens on an 1,800-token session)")
    args = p.parse_args()
    provenance = Provenance.gather()
    if args.suffix_turns:
        rows = suffix_turns(1800, [1, 4, 8, 14, 16, 24, 32, 51, 64, 128, 256])
        write_rows("suffix_turns", rows, provenance, out=args.out, append=args.append)
        worst = max(rows, key=lambda r: r["ratio"])
        print(f"worst ratio {worst['ratio']:.2f} at {worst['suffix_tokens']} tokens (target at most 1.5)")
        return

    source = ensure_packaged_model(DEFAULT_MODEL, default_models_dir())
    model_dir = default_models_dir() / "agent-loop-bench"
    reply = build_model(model_dir, source, args.reasoning, args.visible)
    max_tokens = len(reply) + 8
    logs = Path(tempfile.mkdtemp(prefix="agent-loop-"))
    rows = []
    servers: tuple[tuple[ServerKind, list[str], Stream], ...] = (
        ("lmsp-mlx", ["--model-id", "bench", *own_state(logs, kv_disk=True)], stream_lmsp),
        ("mlx_lm.server", [], stream_mlx_lm),
    )
    for name, flags, fn in servers:
        with serving(server_command(name, "--model", model_dir, *flags), logs / f"{name}.log") as server:
            rows += run_loops(name, fn, server.url, args.loops, args.turns, max_tokens, args.tool)
    print(f"server logs: {logs}", flush=True)
    prefill_s, restore_s = restore_vs_prefill(args.restore_tokens)

    write_rows("agent_loop", rows, provenance, out=args.out, append=args.append,
               notes=[f"restore {args.restore_tokens} tokens: prefill {prefill_s:.3f}s, restore {restore_s:.3f}s"])
    plot(rows, args.out / "agent_loop.png")

    by = {(r["server"], r["turn"]): r for r in rows if r["loop"] == 0}  # the table: the first loop
    print("\n| turn | prompt tokens | prefilled lmsp-mlx | prefilled mlx_lm.server | TTFT lmsp-mlx (s) | TTFT mlx_lm.server (s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for t in range(1, args.turns + 1):
        a, b = by[("lmsp-mlx", t)], by[("mlx_lm.server", t)]
        print(f"| {t} | {a['prompt_tokens']} | {a['prefilled_tokens']} | {b['prefilled_tokens']} | "
              f"{a['ttft_s']:.3f} | {b['ttft_s']:.3f} |")
    ours = statistics.median(r["ttft_s"] for r in rows if r["server"] == "lmsp-mlx" and r["turn"] >= 3)
    theirs = statistics.median(r["ttft_s"] for r in rows if r["server"] == "mlx_lm.server" and r["turn"] >= 3)
    print(f"\nturns 3-{args.turns}: median TTFT lmsp-mlx {ours:.3f}s, mlx_lm.server {theirs:.3f}s, "
          f"ratio {ours / theirs:.3f} (target at most 0.2)")
    print(f"restore {args.restore_tokens} tokens from disk: {restore_s:.3f}s vs prefill {prefill_s:.3f}s, "
          f"{prefill_s / restore_s:.1f}x faster (target at least 10x)")


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("lmsp-mlx", "mlx_lm.server"):
        mine = [r for r in rows if r["server"] == name and r["loop"] == 0]
        ax1.plot([r["turn"] for r in mine], [r["ttft_s"] for r in mine], marker="o", label=name)
        ax2.plot([r["turn"] for r in mine], [r["prefilled_tokens"] for r in mine], marker="o", label=name)
    ax1.set(xlabel="turn", ylabel="time to first token (s)", title="Agent loop, hidden reasoning")
    ax2.set(xlabel="turn", ylabel="prefilled tokens", title="Tokens prefilled per turn")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
