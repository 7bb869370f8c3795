"""Batched decode steps with the kernels against the same batch without them, one run.

    python -m benchmarks.batched_decode [--model PATH] [--batches 1,4,8] [--positions 4096,16384]
                                        [--moe-positions 512] [--repeats 3] [--out DIR] [--append]

Dense: the model (default: the embedded SmolLM2-135M, float32) with a 4-bit KV cache
(`--kv-bits 4`, group 64). B sequences hold random K/V for about N positions each (row i
holds N - 64 i, so a merged batch is left-padded, as a real one is), and 8 decode steps
of all B run:
- "compiled batch": the CPU build's batched step (decode.c's lmsp_decode_batch) over each
  sequence's own quantized cache, attention.c inside it: what the server runs here for a
  llama-family model;
- "merged, kernel": the caches merged into one BatchQuantizedKVCache per layer and the
  batch run through MLX, LMSP_KERNELS=auto: the batched decode_attention (attention.c on
  the CPU build), each row from its own first position; what other models and the GPU
  backends run;
- "merged, no kernel": the same with LMSP_KERNELS=off, mlx-lm's quantized attention (two
  quantized_matmuls) with the batch's left-padded mask;
- "one by one": each sequence through the model's own pass (on the CPU build the
  compiled one-sequence step): what a `--kv-bits` batch did before this.
MoE: a random qwen3_moe model built here (8 layers, hidden 512, 32 experts of 256, top 4,
experts 4-bit g64 and the rest float32, as the CPU build loads a converted checkpoint),
B sequences on plain caches of 512 positions, merged into BatchKVCaches: "kernel" runs
expert_swiglu (experts.c on the CPU build), "no kernel" mlx-lm's gather_qmm SwitchGLU.

Every repeat runs each path back to back on the same caches, so drifts in the machine's
load hit all alike; figures are the best repeat, in decoded tokens per second over the
batch (B tokens a step). Writes benchmarks/results/batched_decode.csv (with the run's
provenance columns; `--append` adds to its history).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache  # noqa: E402

from benchmarks.common import Provenance, output_arguments, write_rows  # noqa: E402
from lmsp_mlx import kernels  # noqa: E402
from lmsp_mlx.cache.batch import BatchQuantizedKVCache  # noqa: E402
from lmsp_mlx.engine.loader import load_model  # noqa: E402
from lmsp_mlx.engine.model_store import DEFAULT_MODEL, default_models_dir, ensure_packaged_model  # noqa: E402

STEPS, GROUP, BITS, STAGGER = 8, 64, 4, 64
DENSE = ("compiled batch", "merged, kernel", "merged, no kernel", "one by one")
PATHS = {"kernel": "auto", "no kernel": "off"}  # the MoE model's


def filled(model, lengths: list[int], quantized: bool) -> list[list]:
    """Each sequence's own cache (one per layer) holding random K/V for its length, with
    room for the timed steps."""
    args = model.args
    heads = args.num_key_value_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    out = []
    for n in lengths:
        caches = [QuantizedKVCache(group_size=GROUP, bits=BITS) if quantized else KVCache() for _ in model.layers]
        for c in caches:
            k, v = mx.random.normal((1, heads, n, dim)), mx.random.normal((1, heads, n, dim))
            c.update_and_fetch(k, v)
        mx.eval([c.state for c in caches])
        out.append(caches)
    return out


def merged(seqs: list[list]) -> list:
    kind = BatchQuantizedKVCache if isinstance(seqs[0][0], QuantizedKVCache) else BatchKVCache
    batch = [kind.merge([s[i] for s in seqs]) for i in range(len(seqs[0]))]
    mx.eval([c.state[:2] for c in batch])
    return batch


def batched_rate(forward, batch: list, b: int) -> float:
    """`forward(tokens, cache)`: a runner's, or a bare model's pass."""
    tokens = mx.full((b, 1), 42, mx.int32)
    start = time.perf_counter()
    for _ in range(STEPS):
        tokens = mx.argmax(forward(tokens, batch)[:, -1:], axis=-1)
        mx.eval(tokens)
    rate = b * STEPS / (time.perf_counter() - start)
    for c in batch:
        c.trim(STEPS)
    return rate


def compiled_rate(batch_step, seqs: list[list]) -> float:
    feeds = [[42] for _ in seqs]
    start = time.perf_counter()
    for _ in range(STEPS):
        logits = batch_step(feeds, seqs)
        feeds = [[int(t)] for t in mx.argmax(logits, axis=-1).tolist()]
    rate = len(seqs) * STEPS / (time.perf_counter() - start)
    for s in seqs:
        for c in s:
            c.trim(STEPS)
    return rate


def one_by_one_rate(forward, seqs: list[list]) -> float:
    start = time.perf_counter()
    for s in seqs:
        token = mx.array([[42]])
        for _ in range(STEPS):
            token = mx.argmax(forward(token, s)[:, -1:], axis=-1)
            mx.eval(token)
    rate = len(seqs) * STEPS / (time.perf_counter() - start)
    for s in seqs:
        for c in s:
            c.trim(STEPS)
    return rate


def moe_model():
    """A random qwen3_moe model: float32, its experts 4-bit (the CPU build's load), kernels in."""
    from mlx_lm.models import qwen3_moe

    config = {"model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
              "moe_intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 4096, "tie_word_embeddings": False, "norm_topk_prob": True}
    mx.random.seed(0)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    nn.quantize(model, group_size=GROUP, bits=BITS, class_predicate=lambda _, m: hasattr(m, "num_experts"))
    mx.eval(model.parameters())
    kernels.expert_layers(model)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="mlx-lm model directory (default: the embedded SmolLM2)")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--positions", default="4096,16384")
    p.add_argument("--moe-positions", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    batches = [int(x) for x in args.batches.split(",") if x]
    rows: list[dict] = []

    lm = load_model(args.model or ensure_packaged_model(DEFAULT_MODEL, default_models_dir()))
    for n in [int(x) for x in args.positions.split(",") if x]:
        for b in batches:
            seqs = filled(lm.model, [n - STAGGER * i for i in range(b)], quantized=True)
            batch = merged(seqs)
            runs = {"compiled batch": lambda: compiled_rate(lm.runner.batch, seqs),
                    "merged, kernel": lambda: batched_rate(lm.runner.forward, batch, b),
                    "merged, no kernel": lambda: batched_rate(lm.runner.forward, batch, b),
                    "one by one": lambda: one_by_one_rate(lm.runner.forward, seqs)}
            if lm.runner.batch is None:
                del runs["compiled batch"]
            best = dict.fromkeys(runs, 0.0)
            for _ in range(args.repeats):
                for path, run in runs.items():
                    os.environ["LMSP_KERNELS"] = "off" if path == "merged, no kernel" else "auto"
                    best[path] = max(best[path], run())
            os.environ["LMSP_KERNELS"] = "auto"
            rows += [{"model": lm.id, "kv": f"{BITS}-bit g{GROUP}", "positions": n, "batch": b, "path": path,
                      "tok_s": round(r, 2)} for path, r in best.items()]
            print(f"{lm.id}, {n} positions, B={b}: " + "; ".join(f"{k} {v:.1f} tok/s" for k, v in best.items()),
                  flush=True)
            del seqs, batch

    moe = moe_model()
    for b in batches:
        seqs = filled(moe, [args.moe_positions - STAGGER * i for i in range(b)], quantized=False)
        best = dict.fromkeys(PATHS, 0.0)
        for _ in range(args.repeats):
            for path, mode in PATHS.items():
                os.environ["LMSP_KERNELS"] = mode
                batch = merged(seqs)
                best[path] = max(best[path], batched_rate(lambda t, c: moe(t, cache=c), batch, b))
        rows += [{"model": "qwen3_moe random (32 experts, top 4)", "kv": "float", "positions": args.moe_positions,
                  "batch": b, "path": path, "tok_s": round(r, 2)} for path, r in best.items()]
        print(f"qwen3_moe, {args.moe_positions} positions, B={b}: "
              + "; ".join(f"{k} {v:.1f} tok/s" for k, v in best.items()), flush=True)
    os.environ["LMSP_KERNELS"] = "auto"

    write_rows("batched_decode", rows, provenance, out=args.out, append=args.append,
               fields=["model", "kv", "positions", "batch", "path", "tok_s"])
    print(f"\nMLX {mx.__version__}, {lm.backend}, best of {args.repeats}, tok/s over the batch")
    for name, paths, ratio in ((lm.id, DENSE, ("merged, kernel", "merged, no kernel")),
                               ("qwen3_moe", tuple(PATHS), ("kernel", "no kernel"))):
        print("\n| model | positions | B | " + " | ".join(paths) + f" | {ratio[0]} / {ratio[1]} |")
        print("|---|---:|---:|" + "---:|" * (len(paths) + 1))
        for key in dict.fromkeys((r["model"], r["positions"], r["batch"]) for r in rows if r["path"] in paths):
            got = {r["path"]: r["tok_s"] for r in rows if (r["model"], r["positions"], r["batch"]) == key}
            cells = [str(got.get(p, "")) for p in paths]
            print(f"| {key[0]} | {key[1]:,} | {key[2]} | " + " | ".join(cells)
                  + f" | {got[ratio[0]] / got[ratio[1]]:.2f}x |")


if __name__ == "__main__":
    main()
