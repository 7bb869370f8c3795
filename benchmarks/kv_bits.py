"""A --kv-bits cache on the CPU build: the compiled passes against MLX's op-by-op path, one run.

    python -m benchmarks.kv_bits [--model PATH] [--bits 4] [--positions 512,4096,16384]
                                 [--prompts 512,2048] [--repeats 3] [--out DIR] [--append]

Decode: one-token steps against a cache already holding N positions (random K/V, the same
for every path; 8 steps a run, then the cache is cut back), through
- "compiled": decode.c's step, which quantizes the new row and runs attention.c itself;
- "op by op": MLX's graph, with attention.c through the kernels' dispatch (`auto`);
- "op by op, reference": MLX's graph with the pure-MLX reference attention;
- "compiled, float cache": the same step over a plain KVCache of the same K/V.
Prefill: a prompt of N random tokens in chunks of 256 (the server's CPU default), through
forward.c over a quantized cache, MLX's graph over one, and forward.c over a float cache.

The paths are switched inside one process (the compiled passes check LMSP_KERNELS; "op by
op" hides the quantized cache from them), and each repeat runs every path back to back,
so drifts in the machine's load hit all alike. Figures are the best of the repeats.
Writes benchmarks/results/kv_bits.csv (with the run's provenance columns; `--append` adds to
its history) and kv_bits.png (with matplotlib).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache  # noqa: E402

from benchmarks.common import Provenance, output_arguments, write_rows  # noqa: E402
from benchmarks.plots import save, tokens_axes  # noqa: E402
from lmsp_mlx.engine import cpu_decode  # noqa: E402
from lmsp_mlx.engine.loader import load_model  # noqa: E402
from lmsp_mlx.engine.model_store import DEFAULT_MODEL, default_models_dir, ensure_packaged_model  # noqa: E402

STEPS, CHUNK, GROUP = 8, 256, 64
# path -> (what the compiled passes see of a quantized cache, LMSP_KERNELS, quantized cache?)
DECODE = {
    "compiled": ("auto", "auto", True),
    "op by op": ("off", "auto", True),
    "op by op, reference": ("off", "reference", True),
    "compiled, float cache": ("auto", "auto", False),
}
PREFILL = {"compiled": ("auto", True), "op by op": ("off", True), "compiled, float cache": ("auto", False)}
COLORS = dict(zip(DECODE, ("tab:blue", "tab:orange", "tab:green", "tab:red")))


def use(passes: str, kernels: str) -> None:
    """Route quantized caches to the compiled passes (`auto`) or not (`off`), and pick the
    kernels' mode for the op-by-op path."""
    cpu_decode.kernel_mode = lambda: passes  # what cpu_decode and cpu_prefill consult
    os.environ["LMSP_KERNELS"] = kernels


def filled(model, n: int, bits: int) -> tuple[list, list]:
    """A quantized and a float cache holding the same random K/V for n positions, with room
    for the timed steps."""
    args = model.args
    heads, dim = args.num_key_value_heads, getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    quantized = [QuantizedKVCache(group_size=GROUP, bits=bits) for _ in model.layers]
    plain = [KVCache() for _ in model.layers]
    for q, p in zip(quantized, plain):
        k, v = mx.random.normal((1, heads, n + STEPS, dim)), mx.random.normal((1, heads, n + STEPS, dim))
        q.update_and_fetch(k, v)
        p.update_and_fetch(k, v)
        q.offset = p.offset = n
    mx.eval([c.state for c in quantized + plain])
    return quantized, plain


def decode_rate(runner, cache: list) -> float:
    token = mx.array([[42]])
    start = time.perf_counter()
    for _ in range(STEPS):
        token = mx.argmax(runner.forward(token, cache)[:, -1:], axis=-1)
        mx.eval(token)
    rate = STEPS / (time.perf_counter() - start)
    for c in cache:
        c.offset -= STEPS
    return rate


def prefill_rate(runner, tokens: list[int], cache: list) -> float:
    start = time.perf_counter()
    for at in range(0, len(tokens), CHUNK):
        mx.eval(runner.hidden(mx.array([tokens[at : at + CHUNK]]), cache=cache))
    return len(tokens) / (time.perf_counter() - start)


def plot(rows: list[dict], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase, unit in zip(axes, ("decode", "prefill"), ("positions in the cache", "prompt tokens")):
        paths = list(DECODE if phase == "decode" else PREFILL)
        for path in paths:
            pts = [(r["tokens"], r["tok_s"]) for r in rows if r["phase"] == phase and r["path"] == path]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=path, color=COLORS[path])
        tokens_axes(ax, unit, f"{phase} tok/s (best)")
    save(fig, title, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="mlx-lm model directory (default: the embedded SmolLM2)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--positions", default="512,4096,16384", help="cache lengths for decode, comma-separated")
    p.add_argument("--prompts", default="512,2048", help="prompt lengths for prefill, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()

    lm = load_model(args.model or ensure_packaged_model(DEFAULT_MODEL, default_models_dir()))
    model, rows = lm.model, []
    if lm.runner.kind != "compiled-cpu" or lm.runner.step is None:
        sys.exit(f"{lm.id}: the compiled decode step does not take this model or build; nothing to compare")
    for n in [int(x) for x in args.positions.split(",") if x]:
        quantized, plain = filled(model, n, args.bits)
        best = dict.fromkeys(DECODE, 0.0)
        for _ in range(args.repeats):
            for path, (passes, kernels, is_quantized) in DECODE.items():
                use(passes, kernels)
                best[path] = max(best[path], decode_rate(lm.runner, quantized if is_quantized else plain))
        rows += [{"phase": "decode", "tokens": n, "path": path, "tok_s": round(r, 2)} for path, r in best.items()]
        print(f"decode, {n} positions: " + "; ".join(f"{k} {v:.1f} tok/s" for k, v in best.items()), flush=True)
    rng = np.random.default_rng(0)
    for n in [int(x) for x in args.prompts.split(",") if x]:
        tokens = [int(t) for t in rng.integers(100, lm.tokenizer.vocab_size - 1, n)]
        best = dict.fromkeys(PREFILL, 0.0)
        for _ in range(args.repeats):
            for path, (passes, is_quantized) in PREFILL.items():
                use(passes, "auto")
                cache = ([QuantizedKVCache(group_size=GROUP, bits=args.bits) for _ in model.layers] if is_quantized
                         else [KVCache() for _ in model.layers])
                best[path] = max(best[path], prefill_rate(lm.runner, tokens, cache))
        rows += [{"phase": "prefill", "tokens": n, "path": path, "tok_s": round(r, 1)} for path, r in best.items()]
        print(f"prefill, {n} tokens: " + "; ".join(f"{k} {v:.0f} tok/s" for k, v in best.items()), flush=True)

    write_rows("kv_bits", rows, provenance, out=args.out, append=args.append,
               fields=["phase", "tokens", "path", "tok_s"])
    title = f"{lm.id}, {args.bits}-bit KV (group {GROUP}) on {lm.backend}, best of {args.repeats}"
    try:
        plot(rows, title, args.out / "kv_bits.png")
    except ImportError:
        print("(no matplotlib: CSV only; pip install -e '.[bench]')")
    for phase, paths, unit in (("decode", DECODE, "positions"), ("prefill", PREFILL, "prompt")):
        print(f"\n| {unit} | " + " | ".join(paths) + " |")
        print("|---:|" + "---:|" * len(paths))
        for n in sorted({r["tokens"] for r in rows if r["phase"] == phase}):
            got = {r["path"]: r["tok_s"] for r in rows if r["phase"] == phase and r["tokens"] == n}
            print(f"| {n:,} | " + " | ".join(f"{got[p]} tok/s" for p in paths) + " |")


if __name__ == "__main__":
    main()
