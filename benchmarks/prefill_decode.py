"""Prefill and decode speed: mlx-lm's stream_generate directly vs. our server's stream, one run.

    python -m benchmarks.prefill_decode [--model PATH] [--lengths 32,128,512] [--decode 64] [--repeats 7]
                                        [--out DIR] [--append]

Both sides run the same weights (loaded by lmsp-mlx's loader: float32 on the CPU backend)
on the same rendered prompt at temperature 0, so they decode the same tokens. For each
prompt length it times, from the caller's side, prefill (prompt tokens / time to the first
token) and decode (later tokens / time from the first to the last) in back-to-back pairs,
writes every run to benchmarks/results/prefill_decode.csv (with the run's provenance
columns; `--append` adds to its history), the medians to .png, and prints a Markdown table
whose decode ratio is the median of the pairs' ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import AbstractContextManager
from pathlib import Path

import httpx

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
from benchmarks.common import (  # noqa: E402
    Provenance, Server, output_arguments, own_state, server_command, serving, sse_events, write_rows,
)
from benchmarks.plots import save, tokens_axes  # noqa: E402
from lmsp_mlx.engine.loader import load_model  # noqa: E402
from lmsp_mlx.engine.model_store import DEFAULT_MODEL, default_models_dir, ensure_packaged_model  # noqa: E402

FILLER = (
    "The river town kept its records in a stone house by the bridge, and every spring the "
    "clerks copied the ledgers again because the damp reached the lower shelves first. "
)
QUESTION = "\nIgnore the text above. Count from 1 to 200, separated by commas: 1, 2, 3,"


def make_messages(tokenizer, target: int) -> list[dict]:
    """A user message whose rendered prompt is close to `target` tokens."""
    per = len(tokenizer.encode(FILLER, add_special_tokens=False))
    base = len(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True))
    repeats = max(0, (target - base) // per)
    return [{"role": "user", "content": FILLER * repeats + QUESTION}]


def direct(lm, messages: list[dict], decode: int) -> dict:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    start = time.perf_counter()
    first = last = None
    n = 0
    for out in stream_generate(lm.model, lm.tokenizer, prompt, max_tokens=decode, sampler=make_sampler(temp=0.0)):
        now = time.perf_counter()
        first = first or now
        last = now
        n = out.generation_tokens
    return {"prompt_tokens": len(prompt), "output_tokens": n,
            "prefill_tps": len(prompt) / (first - start), "decode_tps": (n - 1) / (last - first)}


def served(url: str, model_id: str, messages: list[dict], decode: int) -> dict:
    body = {"model": model_id, "input": messages[0]["content"], "stream": True,
            "temperature": 0, "max_output_tokens": decode}
    start = time.perf_counter()
    first = last = None
    usage = None
    with httpx.stream("POST", url + "/lmsp/v1/responses", json=body, timeout=3600) as r:
        for _, data in sse_events(r.iter_lines()):
            if data["type"] == "response.output_text.delta":
                now = time.perf_counter()
                first = first or now
                last = now
            elif "usage" in data:
                usage = data["usage"]
    n = usage["output_tokens"]
    return {"prompt_tokens": usage["input_tokens"], "output_tokens": n,
            "prefill_tps": usage["input_tokens"] / (first - start), "decode_tps": (n - 1) / (last - first)}


def server(model: Path, model_id: str) -> AbstractContextManager[Server]:
    """The lmsp-mlx server of the comparison, its own store and no checkpoints: a benchmark
    leaves nothing in the user's folders, and every prefill it measures is a real one."""
    folder = Path(tempfile.mkdtemp(prefix="prefill-decode-"))
    log = folder / "server.log"
    print(f"server log: {log}")
    cmd = server_command("lmsp-mlx", "--model", model, "--model-id", model_id, *own_state(folder, kv_disk=False))
    return serving(cmd, log, ready="/healthz", timeout=300)


def plot(summary: list[dict], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("prefill", "decode")):
        for side, marker in (("direct", "o"), ("server", "s")):
            pts = [(r["prompt_tokens"], r[f"{metric}_{side}"]) for r in summary]
            ax.plot(*zip(*pts), marker=marker, label="mlx-lm direct" if side == "direct" else "lmsp-mlx server")
        tokens_axes(ax, "prompt tokens", f"{metric} tok/s (median)")
    save(fig, title, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="mlx-lm model directory (default: the embedded SmolLM2)")
    p.add_argument("--lengths", default="32,128,512", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--decode", type=int, default=64, help="tokens to decode per run")
    p.add_argument("--repeats", type=int, default=7, help="direct/server pairs per length")
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()

    model_path = args.model or ensure_packaged_model(DEFAULT_MODEL, default_models_dir())
    lm = load_model(model_path)
    runs, summary = [], []
    with server(model_path, lm.id) as running:
        url = running.url
        warm = make_messages(lm.tokenizer, 16)
        direct(lm, warm, 4), served(url, lm.id, warm, 4)
        for target in [int(x) for x in args.lengths.split(",")]:
            messages = make_messages(lm.tokenizer, target)
            pairs = []
            for repeat in range(args.repeats):
                # Each pair runs back to back, so drifts in the machine's load hit both alike.
                pair = {"direct": direct(lm, messages, args.decode), "server": served(url, lm.id, messages, args.decode)}
                pairs.append(pair)
                for side, r in pair.items():
                    runs.append({"prompt_target": target, "repeat": repeat, "side": side, **r})
            med = lambda side, key: statistics.median(p[side][key] for p in pairs)  # noqa: E731
            row = {
                "prompt_tokens": pairs[0]["direct"]["prompt_tokens"],
                "prefill_direct": med("direct", "prefill_tps"), "prefill_server": med("server", "prefill_tps"),
                "decode_direct": med("direct", "decode_tps"), "decode_server": med("server", "decode_tps"),
                # The median of the pairs' ratios: the estimate least moved by load bursts.
                "decode_ratio": statistics.median(p["server"]["decode_tps"] / p["direct"]["decode_tps"] for p in pairs),
            }
            summary.append(row)
            print(f"prompt={row['prompt_tokens']:5d} decode direct={row['decode_direct']:.2f} "
                  f"server={row['decode_server']:.2f} ratio={row['decode_ratio']:.3f}", flush=True)

    write_rows("prefill_decode", runs, provenance, out=args.out, append=args.append)
    try:
        plot(summary, f"{lm.id} on {lm.backend} {lm.quantization}", args.out / "prefill_decode.png")
    except ImportError:  # the CSV is written; the table below still prints
        print("(no matplotlib: CSV only; pip install -e '.[bench]')")

    print(f"\n{lm.id}, {lm.backend} {lm.quantization}, {args.decode} decoded tokens, "
          f"medians of {args.repeats} back-to-back pairs\n")
    print("| prompt tokens | prefill tok/s direct | prefill tok/s server | decode tok/s direct | decode tok/s server | decode ratio (median of pairs) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in summary:
        print(f"| {r['prompt_tokens']} | {r['prefill_direct']:.1f} | {r['prefill_server']:.1f} | "
              f"{r['decode_direct']:.2f} | {r['decode_server']:.2f} | {r['decode_ratio']:.3f} |")


if __name__ == "__main__":
    main()
