"""One rank against two on the same model and this one machine, in one run: time to first
token, decode speed and memory per rank.

    python -m benchmarks.distributed [--max-tokens 64] [--repeats 3] [--out DIR] [--append]

Three lmsp-mlx servers in turn, each fresh, on benchmarks/architectures.py's llama (about
100M parameters in float32, 4 layers of width 1024), every one on the MLX runner (the
compiled CPU step does not run across ranks):
- `alone`: one process;
- `tensor`: `mlx.launch -n 2 --backend ring`, each rank half of every layer's heads;
- `pipeline`: the same with `--pipeline`, each rank half of the layers.
Each sends `--repeats` greedy text completions of `--max-tokens` tokens, one at a time, and
reads each rank's resident memory (VmRSS) after them. Both ranks share this machine's 2
cores and talk over loopback TCP, so this measures what splitting costs here, not what two
Macs over Thunderbolt gain. Writes benchmarks/results/distributed.csv with the run's
provenance and prints the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lmsp_mlx.cpu_blas import accelerate

accelerate()  # first: MLX binds its BLAS as mlx.core loads (lmsp_mlx/cpu_blas/__init__.py)
import httpx  # noqa: E402

from benchmarks.architectures import build_benchmark_model  # noqa: E402
from benchmarks.common import Provenance, output_arguments, own_state, serving, sse_events, write_rows  # noqa: E402

FIELDS = ("setup", "ranks", "repeat", "prompt_tokens", "output_tokens", "ttft_s", "decode_tok_s", "rss_mib_per_rank")
MLX_RUNNER = {"LMSP_CPU_DECODE": "0", "LMSP_CPU_PREFILL": "0"}
# Two ranks on 2 cores: a BLAS thread each, or their spinning threads take each other's cores.
RANK_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
PROMPT = "Tell me everything you know about lighthouses, their keepers and the sea. " * 8


def command(setup: str, folder: Path, model: Path) -> list[str]:
    serve = [sys.executable, "-m", "lmsp_mlx.serve", "--model", str(model), "--model-id", "bench",
             *own_state(folder, kv_disk=False), "--speculate", "off"]
    if setup == "alone":
        return ["env", *(f"{k}={v}" for k, v in MLX_RUNNER.items()), *serve]
    launch = [str(Path(sys.executable).parent / "mlx.launch"), "-n", "2", "--backend", "ring",
              *(f"--env={k}={v}" for k, v in {**MLX_RUNNER, **RANK_THREADS}.items()), "--"]
    return [*launch, *serve, *(["--pipeline"] if setup == "pipeline" else [])]


def letters(model: Path) -> dict[str, float]:
    """A logit_bias that keeps a random model's reply to lower-case letters: text that
    streams a token at a time (random bytes would be held back as partial characters)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab()
    return {str(vocab[c]): 100.0 for c in "abcdefghijklmnopqrstuvwxyz" if c in vocab}


def one_reply(url: str, max_tokens: int, bias: dict[str, float]) -> dict:
    """A greedy streamed text completion (every prompt differs from its first token: no KV
    reuse); its time to the first token and its decode speed from the first token to the last."""
    body = {"model": "bench", "prompt": f"{time.time_ns()} {PROMPT}", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "logit_bias": bias}
    sent, stamps, usage = time.perf_counter(), [], {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for _, chunk in sse_events(r.iter_lines()):
            if isinstance(chunk, dict):
                if any(c.get("text") for c in chunk.get("choices") or []):
                    stamps.append(time.perf_counter())
                usage = chunk.get("usage") or usage
    decode = stamps[-1] - stamps[0]
    return {"ttft_s": stamps[0] - sent, "decode_tok_s": (usage["completion_tokens"] - 1) / decode if decode else 0.0,
            "prompt_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}


def rank_rss_mib(port: int) -> list[float]:
    """VmRSS of each process serving on `port`, by rank (one process alone: [its])."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except (OSError, ValueError):
            continue
        if b"lmsp_mlx.serve" not in cmdline or str(port).encode() not in cmdline:
            continue
        rank = next((int(e.split(b"=")[1]) for e in env if e.startswith(b"MLX_RANK=")), 0)
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        found[rank] = rss / 1024
    return [round(found[r], 1) for r in sorted(found)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    output_arguments(p)
    args = p.parse_args()
    provenance = Provenance.gather()
    folder = Path(tempfile.mkdtemp(prefix="distributed-"))
    model = build_benchmark_model(folder / "llama", "llama")
    bias = letters(model)
    rows = []
    for setup in ("alone", "tensor", "pipeline"):
        run_dir = folder / setup
        run_dir.mkdir()
        with serving(command(setup, run_dir, model), run_dir / "server.log") as server:
            one_reply(server.url, 4, bias)  # warm-up
            port = int(server.url.rsplit(":", 1)[1])
            for repeat in range(args.repeats):
                reply = one_reply(server.url, args.max_tokens, bias)
                rss = rank_rss_mib(port)
                row = {"setup": setup, "ranks": len(rss), "repeat": repeat, **reply,
                       "ttft_s": round(reply["ttft_s"], 3), "decode_tok_s": round(reply["decode_tok_s"], 2),
                       "rss_mib_per_rank": " / ".join(map(str, rss))}
                rows.append(row)
                write_rows("distributed", [row], provenance, out=args.out, append=args.append or len(rows) > 1,
                           fields=FIELDS)
                print(f"{setup:>8} #{repeat}: TTFT {row['ttft_s']:.3f} s, {row['decode_tok_s']:.1f} tok/s, "
                      f"RSS {row['rss_mib_per_rank']} MiB", flush=True)
    print("\n| setup | ranks | TTFT (s) | decode tok/s | RSS per rank (MiB, last) |")
    print("|---|---:|---:|---:|---|")
    for setup in ("alone", "tensor", "pipeline"):
        mine = [r for r in rows if r["setup"] == setup]
        print(f"| {setup} | {mine[0]['ranks']} | {statistics.median(r['ttft_s'] for r in mine):.3f} | "
              f"{statistics.median(r['decode_tok_s'] for r in mine):.1f} | {mine[-1]['rss_mib_per_rank']} |")


if __name__ == "__main__":
    main()
