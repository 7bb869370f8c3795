"""One model over two ranks that `mlx.launch -n 2 --backend ring` starts on loopback
(engine/distributed.py), against the same model in one process on the MLX runner.

Tolerance: pipeline parallelism keeps each layer's math whole on one rank, so its logits
are bitwise one process's. Tensor parallelism sums each layer's partial products over the
ranks (all_sum), a different order of addition: its logits may differ by rounding, here
at most 1e-4 on logits of size ~10, and its greedy tokens are the same.

Every test but the last starts processes of its own (the ranks `mlx.launch` starts, or one
process to compare with): `slow`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import HTTP
from tests.servers import ProcessServer
from tests.tiny_model import build_tiny_family_model

ROOT = Path(__file__).resolve().parent.parent
MLX_RUNNER = {"LMSP_CPU_DECODE": "0", "LMSP_CPU_PREFILL": "0"}  # the runner every rank gets


def probe(model: Path, parallel: str) -> dict:
    """tests/distributed_probe.py's rank-0 line: alone for "none", else over 2 ranks."""
    program = [sys.executable, "-m", "tests.distributed_probe", str(model), parallel]
    env = {**os.environ, **MLX_RUNNER, "PYTHONPATH": str(ROOT)}
    if parallel != "none":
        launch = Path(sys.executable).parent / "mlx.launch"
        program = [str(launch), "-n", "2", "--backend", "ring", *(f"--env={k}={v}" for k, v in MLX_RUNNER.items()),
                   f"--env=PYTHONPATH={ROOT}", "--", *program]
    done = subprocess.run(program, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout
    return json.loads(lines[0])


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def family_model(request, tmp_path_factory) -> Path:
    """llama (no pipeline in mlx-lm: ours, LayerPipeline) and qwen3_5 (mlx-lm's PipelineMixin,
    recurrent layers), both with tensor-parallel sharding in mlx-lm."""
    return build_tiny_family_model(tmp_path_factory.mktemp(request.param) / request.param, request.param)


@pytest.fixture(scope="module")
def alone(family_model) -> dict:
    """The family's model in one process: what both splits are held to."""
    return probe(family_model, "none")


@pytest.mark.slow
def test_pipeline_parallel_gives_one_process_logits_bitwise(family_model, alone):
    split = probe(family_model, "pipeline")
    assert alone["runner"] == split["runner"] == "mlx"
    assert split["tokens"] == alone["tokens"]
    assert split["first"] == alone["first"]


@pytest.mark.slow
def test_tensor_parallel_gives_one_process_tokens_within_rounding(family_model, alone):
    split = probe(family_model, "tensor")
    assert split["tokens"] == alone["tokens"]
    assert max(abs(a - b) for a, b in zip(alone["first"], split["first"])) < 1e-4


# -- the server across two ranks ------------------------------------------------------------------


def launched(model: Path, where: Path, *args: str, ranks: int = 2) -> ProcessServer:
    """`mlx.launch -n 2 --backend ring -- python -m lmsp_mlx.serve --model MODEL ARGS` (ranks=1:
    the same server alone), every rank on the MLX runner."""
    launcher = []
    if ranks > 1:
        launcher = [str(Path(sys.executable).parent / "mlx.launch"), "-n", str(ranks), "--backend", "ring",
                    *(f"--env={k}={v}" for k, v in MLX_RUNNER.items()), f"--env=PYTHONPATH={ROOT}", "--"]
    where.mkdir(parents=True, exist_ok=True)
    kv = [] if "--kv-disk-dir" in args else ["--no-kv-disk"]
    return ProcessServer(["--model", str(model), "--model-id", "m", *kv, *args], where / "server.log",
                         env={**MLX_RUNNER, "PYTHONPATH": str(ROOT)}, launcher=launcher).wait_ready(180)


def rank_pid(port: int, rank: int) -> int:
    """The process of `rank` among the ranks serving on `port` (mlx.launch sets MLX_RANK)."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"lmsp_mlx.serve" in cmdline and str(port).encode() in cmdline and f"MLX_RANK={rank}".encode() in env:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} serving on port {port}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build_tiny_family_model(tmp_path_factory.mktemp("llama") / "llama", "llama")


@pytest.fixture(scope="module")
def pair(llama, tmp_path_factory):
    """The tiny llama pipeline-parallel over two ranks, and alone."""
    folder = tmp_path_factory.mktemp("pair")
    split, alone = launched(llama, folder / "split", "--pipeline"), launched(llama, folder / "alone", ranks=1)
    yield split, alone
    split.stop()
    alone.stop()


def complete(server, prompt: list[int], max_tokens: int) -> str:
    r = HTTP.post(server.url + "/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow
def test_four_concurrent_streams_over_two_ranks_get_what_one_process_gives(pair):
    split, alone = pair
    prompts = [[(at + 7 * i) % 250 + 5 for i in range(n)] for n, at in ((40, 3), (9, 11), (23, 17), (61, 5))]
    expected = [complete(alone, p, 40) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: complete(split, p, 40), prompts))
    assert got == expected
    log = split.log()
    assert "rank 0 of 2 holds layers 2-3 of 4 (pipeline parallel)" in log
    assert "rank 1 of 2 holds layers 0-1 of 4 (pipeline parallel)" in log
    assert "lost the other ranks" not in log
    metrics = HTTP.get(split.url + "/metrics").text.splitlines()
    assert "lmsp_distributed_ranks 2" in metrics
    memory = [line for line in metrics if line.startswith("lmsp_distributed_rank_memory_bytes{")]
    assert [line.split("}")[0] for line in memory] == ['lmsp_distributed_rank_memory_bytes{rank="0"',
                                                       'lmsp_distributed_rank_memory_bytes{rank="1"']
    assert all(int(line.split()[-1]) > 0 for line in memory)


@pytest.mark.slow
def test_stored_responses_and_their_continuation_work_over_two_ranks(pair):
    split, alone = pair

    def turn(server, **body) -> dict:
        r = HTTP.post(server.url + "/v1/responses", timeout=120, json={
            "model": "m", "max_output_tokens": 12, "temperature": 0, "store": True, **body})
        assert r.status_code == 200, r.text
        return r.json()

    texts = []
    for server in (split, alone):
        first = turn(server, input="Hello there, how are you?")
        again = HTTP.get(f"{server.url}/v1/responses/{first['id']}", timeout=30).json()
        assert again["status"] == first["status"] == "incomplete" and again["output"] == first["output"]
        second = turn(server, input="And then?", previous_response_id=first["id"])
        texts.append([item["content"] for r in (first, second) for item in r["output"] if item["type"] == "message"])
    assert texts[0] == texts[1] and texts[0]


@pytest.mark.slow
def test_chat_messages_and_a_background_response_over_two_ranks_answer_as_one_process(pair):
    """Every wire API goes through the same worker: Chat, Anthropic's Messages, and a
    background Responses run polled to its end, each answering what one process answers."""

    def answers(server) -> list:
        chat = HTTP.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 10,
            "temperature": 0}).json()["choices"][0]["message"]["content"]
        messages = HTTP.post(server.url + "/v1/messages", timeout=120, json={
            "model": "m", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 10,
            "temperature": 0}).json()["content"]
        job = HTTP.post(server.url + "/v1/responses", timeout=120, json={
            "model": "m", "input": "Tell me more", "max_output_tokens": 10, "temperature": 0,
            "background": True}).json()
        deadline = time.monotonic() + 60
        while (done := HTTP.get(f"{server.url}/v1/responses/{job['id']}", timeout=30).json())["status"] in (
                "queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        return [chat, messages, done["status"], done["output"][-1]["content"]]

    split, alone = pair
    assert answers(split) == answers(alone)


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_is_cancelled_on_every_rank(pair):
    """Its run ends at the next step boundary on both ranks (rank 0's tick says so); the
    ranks stay in step: the next request answers as one process does."""
    split, alone = pair
    with HTTP.stream("POST", split.url + "/v1/completions", timeout=60, json={
            "model": "m", "prompt": [5, 6, 7], "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    prompt = [(11 + 5 * i) % 250 + 5 for i in range(30)]
    assert complete(split, prompt, 20) == complete(alone, prompt, 20)
    assert 'lmsp_requests_total{status="cancelled"} 1' in HTTP.get(split.url + "/metrics").text


@pytest.mark.slow
def test_a_rank_killed_mid_stream_fails_the_stream_and_rank_0_exits(llama, tmp_path):
    server = launched(llama, tmp_path / "killed", "--rank-timeout", "5")
    try:
        with HTTP.stream("POST", server.url + "/v1/responses", timeout=60, json={
                "model": "m", "input": "Hello", "max_output_tokens": 5000, "temperature": 0, "stream": True,
                "store": True}) as r:
            assert r.status_code == 200
            events, killed_at = [], None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    events.append(line.split(":", 1)[1].strip())
                    if events[-1] == "response.output_text.delta" and killed_at is None:
                        os.kill(rank_pid(server.port, 1), signal.SIGKILL)
                        killed_at = time.monotonic()
        assert events[-1] == "response.failed", events[-5:]
        assert time.monotonic() - killed_at < 15
        assert server.proc.wait(timeout=30) is not None
        assert "lost the other ranks" in server.log()
    finally:
        server.stop()


@pytest.mark.slow
def test_a_model_larger_than_one_ranks_budget_serves_over_two(llama, tmp_path):
    """--memory-budget-mb between the model's size and one rank's part of it: one process
    refuses to start, two ranks serve."""
    from lmsp_mlx.engine.footprint import estimate_bytes
    from lmsp_mlx.engine.loader import check_model_dir

    whole, part = (estimate_bytes(llama, check_model_dir(llama), "cpu", ranks) for ranks in (1, 2))
    assert part < 0.7 * whole  # the layers are most of the weights
    budget = f"{(whole + part) / 2 / 2**20:.4f}"
    alone = subprocess.run([sys.executable, "-m", "lmsp_mlx.serve", "--model", str(llama), "--memory-budget-mb", budget,
                            "--no-kv-disk", "--store", str(tmp_path / "s.sqlite3"), "--state-key-file",
                            str(tmp_path / "k")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and "needs about" in alone.stderr and "Traceback" not in alone.stderr
    split = launched(llama, tmp_path / "split", "--memory-budget-mb", budget)
    try:
        complete(split, [5, 6, 7, 8], 4)  # answers 200; its session stays resident on both ranks
        assert "this rank's part of 2" in split.log()
        # What the budget leaves beside a rank's weights is less than one sequence's KV: a
        # sequence runs alone, a second waits for it (rank 0 decides for every rank), and the
        # resident session gives way on both ranks.
        with HTTP.stream("POST", split.url + "/v1/completions", timeout=60, json={
                "model": "m", "prompt": [12, 13, 14, 15, 16], "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "stream": True}) as first:
            lines = first.iter_lines()  # kept: a closed line iterator closes the stream
            next(line for line in lines if line.startswith("data: {"))
            complete(split, [9, 10, 11], 4)  # waits for the first, then answers 200
            assert "data: [DONE]" in list(lines)
        metrics = HTTP.get(split.url + "/metrics").text.splitlines()
        assert "lmsp_memory_waits_total 1" in metrics
        log = split.log()
        assert "memory: a request waits for memory" in log and "lost the other ranks" not in log
        assert "memory budget: evicting a session" in log and "memory budget (rank 0's): evicting a session" in log
    finally:
        split.stop()


@pytest.mark.slow
def test_a_checkpoint_written_over_two_ranks_is_restored_after_both_restart(llama, tmp_path):
    """Each rank writes its shard of the session at shutdown into a folder of its own; both
    restarted, the same prompt restores from every rank's shard and answers as before. With
    one rank's shard missing, no rank restores (and the answer is the same, prefilled)."""
    kv = tmp_path / "kv"
    prompt = [(3 + 7 * i) % 250 + 5 for i in range(120)]
    args = ("--pipeline", "--kv-disk-dir", str(kv), "--kv-checkpoint-min-tokens", "1")
    first = launched(llama, tmp_path / "first", *args)
    try:
        before = complete(first, prompt, 8)
        os.kill(rank_pid(first.port, 0), signal.SIGTERM)  # rank 0 stops every rank; each checkpoints
        assert first.proc.wait(timeout=60) == 0
    finally:
        first.stop()
    shards = sorted(p.parent.parent.name for p in kv.glob("rank-*/*/*.safetensors"))
    assert shards == ["rank-0-of-2", "rank-1-of-2"]
    for shard in kv.glob("rank-1-of-2/*/*.safetensors"):
        shard.rename(shard.with_suffix(".kept"))  # rank 1's shard gone: rank 0 alone must not restore
    lacking = launched(llama, tmp_path / "lacking", *args)
    try:
        assert complete(lacking, prompt, 8) == before
        assert "another rank lacks its shard" in lacking.log()
    finally:
        lacking.stop()
    for shard in kv.glob("rank-1-of-2/*/*.kept"):
        shard.rename(shard.with_suffix(".safetensors"))
    second = launched(llama, tmp_path / "second", *args)
    try:
        assert complete(second, prompt, 8) == before
        log = second.log()
        assert log.count("kv disk: restored") == 2 and "another rank lacks" not in log
    finally:
        second.stop()


@pytest.mark.slow
def test_a_rank_count_the_model_cannot_be_split_over_is_a_one_line_start_error(llama, tmp_path):
    """The tiny llama has 4 attention heads: three ranks cannot share them (tensor parallel)."""
    launch = [str(Path(sys.executable).parent / "mlx.launch"), "-n", "3", "--backend", "ring",
              *(f"--env={k}={v}" for k, v in MLX_RUNNER.items()), f"--env=PYTHONPATH={ROOT}", "--"]
    done = subprocess.run([*launch, sys.executable, "-m", "lmsp_mlx.serve", "--model", str(llama), "--no-kv-disk",
                           "--store", str(tmp_path / "s.sqlite3"), "--state-key-file", str(tmp_path / "k")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert "num_attention_heads = 4 cannot be split over 3 ranks" in out and "Traceback" not in out


def test_pipeline_refuses_a_family_it_would_run_wrongly(tmp_path):
    """gemma3_text has no pipeline in mlx-lm, and its body scales its embeddings: not llama's
    forward, so --pipeline is a start error rather than wrong logits."""
    import mlx.core as mx
    from mlx_lm.utils import load_model as mlx_lm_load

    from lmsp_mlx.engine.distributed import DistributedError, Ranks, split

    model, _ = mlx_lm_load(build_tiny_family_model(tmp_path / "gemma", "gemma3_text"), lazy=True)
    with pytest.raises(DistributedError, match="has no pipeline split"):
        split(model, Ranks(mx.distributed.init(), "pipeline"))  # this process alone: a group of one
