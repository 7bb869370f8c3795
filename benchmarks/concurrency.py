"""Concurrent streaming chat clients: lmsp-mlx against mlx_lm.server, one run.

    python -m benchmarks.concurrency [--widths 1,2,4,8,16] [--max-tokens 128] [--requests 32]
                                     [--max-prompt 2000] [--eos-bias -100] [--timeout 600] [--out DIR]
                                     [--servers lmsp-mlx,mlx_lm.server] [--append]

For each width W, each server is started on its own (never both at once) with room for W
sequences at a time (lmsp-mlx `--max-batch W`, mlx_lm.server `--decode-concurrency W
--prompt-concurrency W`), warmed up with one short request, then W client threads send the
same `--requests` streaming `/v1/chat/completions` requests, each taking the next request
as soon as its last stream ended (so W are in flight until the list runs out). The
requests have mixed prompt lengths (a fixed list from 50 to 2,000 tokens, cycled; lengths
above `--max-prompt` dropped), made of varied words behind a system message that names the
request, so every prompt differs within its first few tokens and no prefix cache makes one
cheap. Every reply is `--max-tokens` long at temperature 0: the chat routes of neither
server take vLLM's `ignore_eos`, so the end-of-turn tokens get `logit_bias` `--eos-bias`
(both servers apply it per sequence, inside their batches), and output tokens are counted
from each server's reported usage (`stream_options.include_usage`; the content deltas
where a stream reports none), so a short reply shows in the counts.

Both servers run the same float32 weights (the default model dequantized once into a temp
directory: MLX's quantized CPU matmul would slow mlx_lm.server down) and the same CPU
math: mlx_lm.server is started through benchmarks/common.py's wrapper, which routes MLX's
matmuls to OpenBLAS and installs lmsp-mlx's fused prefill and compiled decode step into its
model.

Reports per server and width: aggregate output tok/s (all replies' output tokens / the
wall time from the first request sent to the last stream done) and the client-side time
to first token (request sent to first content delta), p50 and p95, and p95 over the
prompts of at most 500 tokens. Writes benchmarks/results/concurrency.csv (a row as each
server and width is done, with the run's provenance columns) and .png and prints a
Markdown table with lmsp-mlx's aggregate over mlx_lm.server's at each width, and
lmsp-mlx's at width 8 over its own at width 1. With `--append` the rows add to the CSV's
history, and the table and plot take each server and width's latest row, so a width
measured in a later run joins the earlier ones.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import httpx

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
from benchmarks.common import (  # noqa: E402
    Provenance, ServerKind, appendable, output_arguments, own_state, percentile, read_rows, server_command, serving,
    sse_events, write_rows,
)
from benchmarks.plots import save, tokens_axes  # noqa: E402
from benchmarks.scripted_model import word_tokens  # noqa: E402
from lmsp_mlx.engine.model_store import DEFAULT_MODEL, default_models_dir, ensure_packaged_model  # noqa: E402

SERVERS: tuple[ServerKind, ...] = ("lmsp-mlx", "mlx_lm.server")
# Prompt lengths in tokens, cycled over the requests: six short (<= 500) and four long.
LENGTHS = (50, 1500, 100, 700, 200, 2000, 300, 1000, 400, 500)
SHORT = 500  # prompts up to this many tokens make ttft_p95_short_s
TAIL = "\nWrite a long story that uses the words above."
FIELDS = ("server", "width", "clients", "output_tokens", "wall_s", "aggregate_tok_s", "ttft_p50_s", "ttft_p95_s",
          "ttft_p95_short_s", "requests", "short_replies", "errors", "mean_prompt_tokens")


def float32_model(out: Path) -> tuple[Path, set[int], object]:
    """The default model as plain float32 safetensors in `out` (both servers load it);
    returns the directory, the end-of-turn token ids, and its mlx-lm tokenizer."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from lmsp_mlx.engine.loader import load_model

    source = ensure_packaged_model(DEFAULT_MODEL, default_models_dir())
    lm = load_model(source)  # dequantized to float32 on the CPU
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in source.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    eos = set(lm.eos_token_ids)
    del lm
    gc.collect()

    model, tokenizer = load(str(out))  # what mlx_lm.server will do with it
    params = dict(tree_flatten(model.parameters()))
    dtypes = {str(v.dtype) for v in params.values()}
    quantized = [n for n, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if dtypes != {"mlx.core.float32"} or quantized:
        raise SystemExit(f"the float32 copy in {out} is not float32: dtypes {dtypes}, quantized {quantized[:3]}")
    eos |= set(tokenizer.eos_token_ids or ())
    print(f"float32 copy: {out} ({len(params)} tensors, "
          f"{sum(v.size for v in params.values()) / 1e6:.1f}M parameters, end-of-turn ids {sorted(eos)})", flush=True)
    del model, params
    gc.collect()
    mx.clear_cache()
    return out, eos, tokenizer


def build_prompts(tokenizer, lengths: list[int], count: int, width: int) -> list[tuple[int, list[dict]]]:
    """`count` (target prompt tokens, messages) pairs, the lengths cycled; deterministic."""
    vocab = tokenizer.get_vocab()
    inverse = {i: t for t, i in vocab.items()}
    pool = [" " + inverse[i][1:] for i in word_tokens(vocab, 3000, set())]
    prompts = []
    for i in range(count):
        target = lengths[i % len(lengths)]
        system = f"{i + 1}: request {i + 1} of {count}, {width} clients."  # differs from its first word on
        frame = len(tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": TAIL}], add_generation_prompt=True))
        rng = random.Random(1000 * width + i)
        words = "".join(rng.choice(pool) for _ in range(target + 8)).lstrip()
        ids = tokenizer.encode(words, add_special_tokens=False)[: max(1, target - frame)]
        prompts.append((target, [{"role": "system", "content": system},
                                 {"role": "user", "content": tokenizer.decode(ids) + TAIL}]))
    return prompts


def stream_chat(client: httpx.Client, body: dict, deadline: float, stop: threading.Event) -> dict:
    """One streamed chat completion: when it was sent and done, time to first content,
    output tokens (usage, else content deltas), prompt tokens, and the error if any."""
    def in_time() -> None:
        if time.perf_counter() > deadline or stop.is_set():
            raise TimeoutError("the request ran past its deadline")

    sent = time.perf_counter()
    first, deltas, usage, error = None, 0, None, None
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            for _, chunk in sse_events(r.iter_lines(), in_time):
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content"):
                        first = first or time.perf_counter()
                        deltas += 1
                usage = chunk.get("usage") or usage
    except Exception as exc:  # noqa: BLE001 - one failed request is counted, the run goes on
        error = f"{type(exc).__name__}: {exc}"
    done = time.perf_counter()
    tokens = usage["completion_tokens"] if usage and "completion_tokens" in usage else deltas
    return {"sent": sent, "done": done, "ttft_s": None if first is None else first - sent,
            "output_tokens": tokens, "prompt_tokens": (usage or {}).get("prompt_tokens"), "error": error}


def measure(url: str, model: str, prompts: list[tuple[int, list[dict]]], width: int, max_tokens: int,
            bias: dict[str, float], timeout: float) -> list[dict]:
    """Send every prompt with `width` client threads; one result per prompt."""
    stop = threading.Event()
    limits = httpx.Limits(max_connections=width + 2, max_keepalive_connections=width + 2)
    timeouts = httpx.Timeout(connect=10, read=min(timeout, 180), write=30, pool=timeout)

    def one(item: tuple[int, list[dict]]) -> dict:
        target, messages = item
        body = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": max_tokens, "temperature": 0}
        if bias:
            body["logit_bias"] = bias
        result = stream_chat(client, body, time.perf_counter() + timeout, stop)
        return {"target": target, **result}

    with httpx.Client(base_url=url, timeout=timeouts, limits=limits) as client, \
            ThreadPoolExecutor(max_workers=width) as pool:
        futures = [pool.submit(one, p) for p in prompts]  # W workers: W requests in flight
        # The whole width ends by then: every request is bounded by `timeout` once sent.
        _, late = wait(futures, timeout=timeout * (math.ceil(len(prompts) / width) + 1))
        if late:
            stop.set()
            for f in late:
                f.cancel()
        results = [f.result() for f in futures if not f.cancelled()]
    return results + [{"target": t, "sent": None, "done": None, "ttft_s": None, "output_tokens": 0,
                       "prompt_tokens": None, "error": "not run: the width's deadline passed"}
                      for (t, _), f in zip(prompts, futures) if f.cancelled()]


def summarize(name: str, width: int, results: list[dict], max_tokens: int) -> dict:
    sent = [r["sent"] for r in results if r["sent"] is not None]
    done = [r["done"] for r in results if r["done"] is not None]
    wall = max(done) - min(sent) if sent and done else float("nan")
    tokens = sum(r["output_tokens"] for r in results)
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None and not r["error"]]
    short = [r["ttft_s"] for r in results if r["ttft_s"] is not None and not r["error"] and r["target"] <= SHORT]
    prompt_tokens = [r["prompt_tokens"] for r in results if r["prompt_tokens"]]

    def pct(xs: list[float], q: float) -> float:
        found = percentile(xs, q / 100)
        return float("nan") if found is None else found

    return {"server": name, "width": width, "clients": width, "output_tokens": tokens, "wall_s": wall,
            "aggregate_tok_s": tokens / wall if wall > 0 else float("nan"),
            "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95), "ttft_p95_short_s": pct(short, 95),
            "requests": len(results), "short_replies": sum(r["output_tokens"] < max_tokens for r in results),
            "errors": sum(bool(r["error"]) for r in results),
            "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else float("nan")}


def command(name: ServerKind, model_dir: Path, width: int, folder: Path) -> tuple[list[str], str]:
    """The server's command line at `width` (the port appended later) and its model id."""
    if name == "lmsp-mlx":
        return server_command(name, "--model", model_dir, "--model-id", "bench", *own_state(folder, kv_disk=False),
                              "--max-batch", width), "bench"
    return server_command(name, "--model", model_dir, "--decode-concurrency", width,
                          "--prompt-concurrency", width), "default_model"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="1,2,4,8,16", help="concurrent clients (and server batch widths)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per reply")
    p.add_argument("--requests", type=int, default=32, help="requests per server and width (at least the width)")
    p.add_argument("--max-prompt", type=int, default=2000, help="drop the prompt lengths above this")
    p.add_argument("--eos-bias", type=float, default=-100.0,
                   help="logit_bias on the end-of-turn tokens, for full-length replies (0: none)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--servers", default=",".join(SERVERS), help="which of them to run")
    output_arguments(p, append_help="add this run's rows to the CSV's history; the table and plot take each server "
                                    "and width's latest row (a width added in a later run)")
    args = p.parse_args()
    provenance = Provenance.gather()
    widths = [int(w) for w in args.widths.split(",")]
    servers = [name for name in SERVERS if name in args.servers.split(",")]
    lengths = [n for n in LENGTHS if n <= args.max_prompt] or [args.max_prompt]

    # Asked first: a header mismatch found after an hour of measuring would cost the hour.
    append = args.append and appendable("concurrency", FIELDS, args.out)
    earlier = read_rows(args.out / "concurrency.csv") if append else []

    folder = Path(tempfile.mkdtemp(prefix="concurrency-"))
    model_dir, eos, tokenizer = float32_model(folder / "model-f32")
    bias = {str(i): args.eos_bias for i in sorted(eos)} if args.eos_bias else {}
    rows = []
    try:
        for width in widths:
            prompts = build_prompts(tokenizer, lengths, max(args.requests, width), width)
            for name in servers:
                run_dir = folder / f"{name}-w{width}"
                run_dir.mkdir()
                cmd, model = command(name, model_dir, width, run_dir)
                if (load := os.getloadavg()[0]) > 0.5:  # on 2 cores another busy process skews both servers
                    print(f"warning: load average {load:.2f} before {name} at width {width}", flush=True)
                with serving(cmd, run_dir / "server.log") as server:
                    warm = [(50, [{"role": "user", "content": f"Warm-up {name} {width}: say hello."}])]
                    if (error := measure(server.url, model, warm, 1, 8, {}, args.timeout)[0]["error"]):
                        raise SystemExit(f"{name} failed its warm-up request: {error}")
                    row = summarize(name, width, measure(server.url, model, prompts, width, args.max_tokens, bias,
                                                         args.timeout), args.max_tokens)
                rows.append(row)
                # After each, so a cut-short run leaves its rows: the first replaces the file unless --append.
                write_rows("concurrency", [rounded(row)], provenance, out=args.out, append=append, fields=FIELDS)
                append = True
                print(f"{name:>14} width {width:2d}: {row['output_tokens']:5d}/{row['requests'] * args.max_tokens} "
                      f"tokens in {row['wall_s']:7.2f}s = {row['aggregate_tok_s']:7.1f} tok/s, "
                      f"TTFT p50 {row['ttft_p50_s']:.3f}s p95 {row['ttft_p95_s']:.3f}s, "
                      f"errors {row['errors']}", flush=True)
    finally:
        print(f"server logs and the float32 model: {folder}", flush=True)
    if not rows:
        raise SystemExit("nothing measured")
    latest = {(r["server"], r["width"]): r for r in earlier + rows}  # a later row stands for its server and width
    rows = sorted(latest.values(), key=lambda r: (r["width"], SERVERS.index(r["server"])))
    widths = sorted({r["width"] for r in rows})
    plot(rows, widths, args.out / "concurrency.png")

    by = {(r["server"], r["width"]): r for r in rows}
    print(f"\n{len(lengths)} prompt lengths {lengths} cycled over max(width, {args.requests}) requests per server "
          f"and width, {args.max_tokens} output tokens asked per reply, end-of-turn logit_bias {args.eos_bias:g}\n")
    print("| width | server | output tokens | of asked | short replies | errors | wall (s) | aggregate tok/s "
          "| TTFT p50 (s) | TTFT p95 (s) | TTFT p95, prompts <= 500 (s) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['width']} | {r['server']} | {r['output_tokens']} | {r['requests'] * args.max_tokens} | "
              f"{r['short_replies']} | {r['errors']} | {r['wall_s']:.2f} | {r['aggregate_tok_s']:.1f} | "
              f"{r['ttft_p50_s']:.3f} | {r['ttft_p95_s']:.3f} | {r['ttft_p95_short_s']:.3f} |")
    print()
    for width in widths:
        ours, theirs = by.get(("lmsp-mlx", width)), by.get(("mlx_lm.server", width))
        if ours and theirs and theirs["aggregate_tok_s"] > 0:
            print(f"width {width:2d}: lmsp-mlx aggregate / mlx_lm.server's = "
                  f"{ours['aggregate_tok_s'] / theirs['aggregate_tok_s']:.3f}")
    top = 8 if ("lmsp-mlx", 8) in by else max(widths)
    if ("lmsp-mlx", 1) in by and top != 1:
        print(f"lmsp-mlx aggregate at width {top} / at width 1 = "
              f"{by[('lmsp-mlx', top)]['aggregate_tok_s'] / by[('lmsp-mlx', 1)]['aggregate_tok_s']:.3f}")


def rounded(row: dict) -> dict:
    """The row as the CSV keeps it: 4 decimals."""
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def plot(rows: list[dict], widths: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, marker in zip(SERVERS, ("o", "s")):
        mine = sorted((r for r in rows if r["server"] == name), key=lambda r: r["width"])
        ax1.plot([r["width"] for r in mine], [r["aggregate_tok_s"] for r in mine], marker=marker, label=name)
        ax2.plot([r["width"] for r in mine], [r["ttft_p95_s"] for r in mine], marker=marker, label=name)
    tokens_axes(ax1, "concurrent streaming clients", "aggregate output tok/s")
    tokens_axes(ax2, "concurrent streaming clients", "time to first token, p95 (s)")
    for ax in (ax1, ax2):
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.minorticks_off()
    save(fig, "Concurrent chat streams: lmsp-mlx vs mlx_lm.server (same float32 weights, same CPU math)", path)


if __name__ == "__main__":
    main()
