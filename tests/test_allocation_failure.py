"""An allocation failure inside a step is one request's failure: the batched step that
fails is retried one sequence at a time, the sequence whose own step fails ends with
`response.failed`, and the others go on with the tokens they get alone. The worker goes
on serving.

MLX's CPU build cannot be made to fail an allocation safely (a huge one kills the process
with a segmentation fault), so the failure is injected through the runner every step goes
through: `FaultyRunner` is the model's own runner, raising what Metal's allocator raises
wherever a forward feeds the poisoned token."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tests.helpers import HTTP, ask
from tests.test_families import on_the_mlx_runner

from lmsp_mlx.engine.batch import Batch, generate
from lmsp_mlx.engine.generate import GenerationParams, Penalties
from lmsp_mlx.engine.loader import load_model
from lmsp_mlx.engine.sequence import Phase, Sequence

OOM = "[metal::malloc] Attempting to allocate 4294967296 bytes which is greater than the maximum allowed buffer size"


class FaultyRunner:
    """`inner`, but a forward whose tokens hold `poison` raises as an allocation failure.
    Every step goes through `forward` (no compiled batched step: the MLX path)."""

    kind = "mlx"
    batch = None

    def __init__(self, inner, poison: int) -> None:
        self.inner, self.poison = inner, poison
        self.failures = 0

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        if self.poison in tokens.reshape(-1).tolist():
            self.failures += 1
            raise RuntimeError(OOM)
        return self.inner.forward(tokens, cache)

    def prefill(self, tokens: mx.array, cache: list) -> None:
        self.inner.prefill(tokens, cache)

    def hidden(self, *args, **kwargs) -> mx.array:
        return self.inner.hidden(*args, **kwargs)

    def last_logits(self, tokens: list[int], cache: list) -> mx.array:
        return self.inner.last_logits(tokens, cache)

    def describe(self) -> str:
        return "faulty " + self.inner.describe()


@pytest.fixture(scope="module")
def mlx_lm_model(tiny_model_dir):
    patch = on_the_mlx_runner()
    try:
        lm = load_model(tiny_model_dir)
    finally:
        patch.undo()
    assert lm.runner.kind == "mlx"
    return lm


def prompts(lm) -> list[GenerationParams]:
    return [GenerationParams(prompt=lm.tokenizer.encode(f"Story {i}: count these tokens"), max_tokens=12,
                             temperature=0.0, ignore_eos=True) for i in range(4)]


def test_a_failing_sequence_fails_alone_and_the_batch_goes_on(mlx_lm_model):
    lm = mlx_lm_model
    poison = lm.tokenizer.convert_tokens_to_ids("Q")
    wanted = prompts(lm)
    # The second sequence is made to sample the poisoned token first: the next step feeds it.
    wanted[1] = GenerationParams(**{**wanted[1].__dict__, "penalties": Penalties(bias=((poison, 100.0),))})
    expected = {i: [] for i in (0, 2, 3)}
    for i in expected:
        generate(lm, wanted[i], emit=lambda e: None, sampled=expected[i])
    faulty = FaultyRunner(lm.runner, poison)
    lm.runner = faulty
    try:
        seqs = [Sequence(lm, p, make_prompt_cache(lm.model), emit=lambda e: None) for p in wanted]
        batch, failed = Batch(lm), {}
        while live := [s for s in seqs if s.phase is not Phase.DONE and s not in failed]:
            if (s := next((s for s in live if s.phase is Phase.PREFILL), None)) is not None:
                s.prefill_chunk(64)
                continue
            failed.update(batch.step([s for s in live if s.phase is Phase.DECODE]))
            for s in seqs:
                if s.phase is Phase.DONE or s in failed:
                    batch.release(s)
    finally:
        lm.runner = faulty.inner
    assert list(failed) == [seqs[1]] and str(failed[seqs[1]]) == OOM
    assert faulty.failures == 2  # the batched step, then the poisoned sequence's own
    assert {i: seqs[i].sampled for i in expected} == expected  # the others' tokens, as alone


def test_the_server_fails_that_request_and_serves_the_others(start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny")
    slot = server.engine.models.slots["tiny"]
    poison = slot.lm.tokenizer.convert_tokens_to_ids("Q")
    faulty = FaultyRunner(slot.lm.runner, poison)
    slot.lm.runner = faulty

    results: dict[str, dict] = {}

    def run(name, **fields):
        r = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(**fields), timeout=120)
        results[name] = {**r.json(), "http": r.status_code}

    threads = [threading.Thread(target=run, args=(f"ok{i}",), kwargs={"max_output_tokens": 40}) for i in range(3)]
    threads.append(threading.Thread(target=run, args=("poisoned",), kwargs={
        "max_output_tokens": 40, "logit_bias": {str(poison): 100}}))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    poisoned = results["poisoned"]  # a problem document: 507, saying the server ran out of memory for it
    assert poisoned["http"] == poisoned["status"] == 507, poisoned
    assert poisoned["type"].endswith("insufficient_memory") and "ran out of memory" in poisoned["detail"]
    assert [(results[f"ok{i}"]["http"], results[f"ok{i}"]["status"]) for i in range(3)] == [(200, "incomplete")] * 3
    assert faulty.failures >= 1
    again = HTTP.post(server.url + "/lmsp/v1/responses", json=ask(), timeout=60)  # the worker goes on
    assert again.status_code == 200 and again.json()["status"] == "incomplete"  # its 8 tokens, as ever
