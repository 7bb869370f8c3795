"""Every family batches on the path a Mac runs: tiny random models built with mlx-lm's own
classes (sliding-window, recurrent-hybrid, MLA, llama with the compiled step off) decode
several sequences in one merged batch, each layer in the batch form of its own cache kind,
and each sequence gets the greedy tokens it gets alone, while others join and leave.

Tolerance: none on tokens. A merged batch sums padded rows in another order than a
sequence alone, so logits may differ in the last bits; the models' output heads are scaled
so that greedy choices have no near-tie.
"""

from __future__ import annotations

import json
from dataclasses import replace
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmsp_mlx.engine.batch import Batch, Merged, chunk_size, generate, layer_kind, next_prefill, prefill_group
from lmsp_mlx.engine.generate import GenerationParams
from lmsp_mlx.engine.loader import load_model
from lmsp_mlx.engine.sequence import Phase, Sequence
from mlx_lm.models.cache import make_prompt_cache
from tests.helpers import HTTP, ask
from tests.test_engine import wait_for_metric
from tests.tiny_model import FAMILIES, build_tiny_family_model


def on_the_mlx_runner() -> pytest.MonkeyPatch:
    """The environment a load reads to give llama the MLX runner, as a Mac runs it: neither
    the compiled CPU decode step nor its compiled prefill (every other family has it anyway)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("LMSP_CPU_DECODE", "0")
    patch.setenv("LMSP_CPU_PREFILL", "0")
    return patch


@pytest.fixture(scope="module", params=FAMILIES)
def family_lm(request, tmp_path_factory):
    patch = on_the_mlx_runner()
    try:
        lm = load_model(build_tiny_family_model(tmp_path_factory.mktemp(request.param) / request.param, request.param))
    finally:
        patch.undo()
    assert lm.runner.kind == "mlx"
    return lm


def params(lm) -> list[GenerationParams]:
    """Four prompts of different lengths, longer than a sliding window of 16; the second
    ends early, so it leaves the batch midway and the others go on without it."""
    vocab = lm.tokenizer.vocab_size
    prompt = lambda n, at: [(at + 7 * i) % (vocab - 10) + 5 for i in range(n)]  # noqa: E731
    return [GenerationParams(prompt=prompt(n, at), max_tokens=m, temperature=0.0)
            for n, at, m in ((40, 3, 30), (9, 11, 6), (23, 17, 30), (61, 5, 24))]


def alone(lm, p: GenerationParams) -> list[int]:
    sampled: list[int] = []
    generate(lm, p, emit=lambda e: None, sampled=sampled)
    return sampled


def together(lm, seqs: list[Sequence], joins_at: dict[int, int]) -> list[int]:
    """Step the sequences as the worker does; sequence i starts after `joins_at[i]` steps.
    Returns how many sequences each decode step merged."""
    batch, step, widths = Batch(lm), 0, []
    while live := [s for i, s in enumerate(seqs) if s.phase is not Phase.DONE and joins_at.get(i, 0) <= step]:
        if group := prefill_group(live, 64, lm):
            batch.prefill(group)
        elif (s := next_prefill(live)) is not None:
            s.prefill_chunk(chunk_size(s, 64, len(live) > 1))
        decoding = [s for s in live if s.phase is Phase.DECODE]
        assert batch.step(decoding) == {}
        widths.append(len(batch._merged.members))
        for s in seqs:
            if s.phase is Phase.DONE:
                batch.release(s)
        step += 1
    return widths


def test_a_merged_batch_gives_each_sequence_its_tokens_alone_as_others_join_and_leave(family_lm, caplog):
    lm = family_lm
    expected = [alone(lm, p) for p in params(lm)]
    assert all(len(e) > 1 for e in expected)
    seqs = [Sequence(lm, p, make_prompt_cache(lm.model), emit=lambda e: None) for p in params(lm)]
    kinds = [type(c) for c in seqs[0].cache]
    with caplog.at_level("INFO", logger="lmsp_mlx.engine"):
        widths = together(lm, seqs, joins_at={3: 3})  # the longest prompt joins a running batch
    assert [s.sampled for s in seqs] == expected
    assert "steps outside the batch" not in caplog.text
    assert max(widths) == 4 and 3 in widths  # all four merged at once, and fewer once one left
    assert all([type(c) for c in s.cache] == kinds for s in seqs)  # each handed back in its own kinds


def test_prompts_that_arrive_together_prefill_in_one_forward_and_get_their_tokens_alone(family_lm):
    """Four prompts of different lengths, all waiting at once: one forward prefills them
    (right-padded, as mlx-lm's prompt batching), the next decode step gives all four their
    first tokens, and each gets the tokens it gets alone."""
    lm = family_lm
    expected = [alone(lm, p) for p in params(lm)]
    seqs = [Sequence(lm, p, make_prompt_cache(lm.model), emit=lambda e: None) for p in params(lm)]
    batch = Batch(lm)
    if lm.model_type == "nemotron_h":  # its mixer loses a right-padded prompt's state: each prefills alone
        assert prefill_group(seqs, 64, lm) == []
        return
    assert same(prefill_group(seqs, 64, lm), seqs)
    batch.prefill(seqs)
    assert all(s.phase is Phase.DECODE and s.pending == [s.params.prompt[-1]] for s in seqs)
    assert batch.step(seqs) == {} and all(len(s.sampled) == 1 for s in seqs)
    while live := [s for s in seqs if s.phase is Phase.DECODE]:
        assert batch.step(live) == {}
        for s in seqs:
            if s.phase is Phase.DONE:
                batch.release(s)
    assert [s.sampled for s in seqs] == expected
    assert all([type(c) for c in s.cache] == [type(c) for c in make_prompt_cache(lm.model)] for s in seqs)


def test_every_layer_of_every_family_has_a_batch_kind(family_lm):
    cache = make_prompt_cache(family_lm.model)
    assert all(layer_kind(c) is not None for c in cache), [type(c).__name__ for c in cache]


def test_a_leaver_frees_its_row_and_a_joiner_takes_it(family_lm):
    """Leaving extracts one row and leaves it free; a joiner is written into that row, where
    every layer's batch form can take it (all but sliding-window ones): nobody else's
    cache is copied."""
    lm = family_lm
    short = params(lm)[1]  # 9 tokens: shorter than the batch's positions, so it fits a row
    seqs = [Sequence(lm, p, make_prompt_cache(lm.model), emit=lambda e: None) for p in [*params(lm)[:3], short]]
    for s in seqs:
        while s.phase is Phase.PREFILL:
            s.prefill_chunk(64)
    merged = Merged()
    merged.step(lm, seqs[:3])
    merged.step(lm, seqs[:3])
    merged.release(seqs[1])
    assert same(merged.members, [seqs[0], None, seqs[2]])
    assert [type(c) for c in seqs[1].cache] == [type(c) for c in make_prompt_cache(lm.model)]
    merged.step(lm, [seqs[0], seqs[2], seqs[3]])
    rotating = any("Rotating" in type(c).__name__ for c in make_prompt_cache(lm.model))
    if rotating:  # a sliding-window batch's rows share one ring position: the joiner is appended
        assert same(merged.members, [seqs[0], seqs[2], seqs[3]])
    else:
        assert same(merged.members, [seqs[0], seqs[3], seqs[2]])  # row 1 again: no batch was extended


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def test_a_multimodal_config_gives_its_text_models_context_and_vocabulary(tmp_path):
    """Qwen3.5 and Gemma 3 checkpoints keep the language model's settings under
    `text_config`: the context length and the vocabulary (which logit_bias is checked
    against) come from there, not from defaults."""
    import json

    path = build_tiny_family_model(tmp_path / "qwen3_5", "qwen3_5")
    flat = json.loads((path / "config.json").read_text())
    text = {k: v for k, v in flat.items() if k != "model_type"} | {"max_position_embeddings": 8192}
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    lm = load_model(path)
    assert lm.context_length == 8192
    assert lm.vocab_size == flat["vocab_size"]


# -- through the server ------------------------------------------------------------------------


def serve_family(arch: str, start, tmp_path_factory):
    path = build_tiny_family_model(tmp_path_factory.mktemp(arch) / arch, arch)
    patch = on_the_mlx_runner()  # the server inherits it and reads it at load
    try:
        server = start("--model", str(path), "--model-id", "m", "--no-kv-disk", "--max-batch", "4")
    finally:
        patch.undo()
    assert "runner for m: MLX" in server.log()
    return server


@pytest.fixture(scope="module", params=FAMILIES)
def family_server(request, start_module_server, tmp_path_factory):
    return serve_family(request.param, start_module_server, tmp_path_factory)


# One family per batch form, for the costlier server test: plain (llama, compiled step off),
# MLA, recurrent rows beside plain, sliding-window beside plain. The engine test above
# covers every family.
KINDS = ("llama", "deepseek_v3", "qwen3_next", "gpt_oss")


def complete(server, prompt: list[int], max_tokens: int) -> str:
    r = HTTP.post(server.url + "/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow  # 320 decode steps twice per family: 2-3 s each
@pytest.mark.parametrize("arch", KINDS)
def test_four_concurrent_requests_one_joining_and_leaving_get_their_tokens_alone(arch, start_server,
                                                                                 tmp_path_factory):
    family_server = serve_family(arch, start_server, tmp_path_factory)
    """Prompts of 40, 9, 23 and 61 tokens (past the sliding window of 16). Three ask for 100
    tokens; once they decode together, the fourth (20 tokens) joins their batch and leaves
    it while they decode on."""
    bodies = [([(at + 7 * i) % 250 + 5 for i in range(n)], m) for n, at, m in
              ((40, 3, 100), (9, 11, 20), (23, 17, 100), (61, 5, 100))]
    expected = [complete(family_server, *b) for b in bodies]
    got: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, complete(family_server, *bodies[i])))
               for i in range(4)]
    for i in (0, 2, 3):
        threads[i].start()
    wait_for_metric(family_server, "lmsp_batch_sequences 3")
    threads[1].start()
    for t in threads:
        t.join(timeout=120)
    assert [got[i] for i in range(4)] == expected
    assert "steps outside the batch" not in family_server.log()


def test_every_route_answers(family_server):
    url, user = family_server.url, {"role": "user", "content": "Hello there"}
    replies = [
        HTTP.post(url + "/lmsp/v1/responses", json=ask("Hello there", model="m", max_output_tokens=8)),
        HTTP.post(url + "/v1/responses", json={"model": "m", "input": "Hello there", "max_output_tokens": 8}),
        HTTP.post(url + "/v1/chat/completions", json={"model": "m", "messages": [user], "max_tokens": 8,
                                                       "logit_bias": {"2": -100}}),  # the vocabulary is known
        HTTP.post(url + "/v1/completions", json={"model": "m", "prompt": "Hello there", "max_tokens": 8}),
        HTTP.post(url + "/v1/messages", json={"model": "m", "messages": [user], "max_tokens": 8}),
    ]
    assert [r.status_code for r in replies] == [200] * 5, [r.text for r in replies if r.status_code != 200]


def test_prompts_sent_at_once_get_their_replies_alone_and_later_turns_reuse_the_cache(family_server):
    """Four short chats sent at once (they may prefill together, a batch's rows handed back
    as each one's own cache): each gets the reply it gets alone. A second turn then reuses
    the first turn's KV, and a retry of that turn goes back to the turn boundary (a
    snapshot, for caches that cannot be trimmed) with the same reply."""
    url = family_server.url

    def chat(messages: list[dict]) -> dict:
        r = HTTP.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": messages, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    firsts = [[{"role": "user", "content": f"Question {i}: " + "tell me about the river " * (i + 1)}] for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(chat, firsts))
    assert [c["choices"][0]["message"]["content"] for c in together] == \
        [chat(m)["choices"][0]["message"]["content"] for m in firsts]
    turn = [*firsts[0], together[0]["choices"][0]["message"], {"role": "user", "content": "And the sea?"}]
    second, retry = chat(turn), chat(turn)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert retry["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert retry["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
                          "required": ["city"], "additionalProperties": False}}


def test_a_required_tool_call_comes_back_as_a_call_on_every_family(family_server):
    """A random model calls a tool only when told to: with the tool named, the grammar
    makes its reply one call whose arguments fit the schema, on Chat and on Messages."""
    url, user = family_server.url, {"role": "user", "content": "Weather in Oslo?"}
    chat = HTTP.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "m", "messages": [user], "max_tokens": 200, "temperature": 0,
        "tools": [{"type": "function", "function": {**WEATHER, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Oslo", "Paris")
    messages = HTTP.post(url + "/v1/messages", timeout=120, json={
        "model": "m", "messages": [user], "max_tokens": 200,
        "tools": [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}],
        "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert messages.status_code == 200, messages.text
    body = messages.json()
    assert body["stop_reason"] == "tool_use"
    [use] = [b for b in body["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather" and use["input"]["city"] in ("Oslo", "Paris")


def test_logprobs_in_a_merged_batch_are_the_ones_alone(family_lm):
    """Each row of a merged batch gives its sequence's logprobs (the model's raw distribution),
    as that sequence alone gets them, within the rounding of a merged batch's other summation
    order."""
    from lmsp_mlx.engine.events import TextDelta

    lm = family_lm
    wanted = [replace(p, logprobs=3) for p in params(lm)]

    def entries_alone(p):
        out = []
        generate(lm, p, emit=lambda e: out.extend(e.logprobs) if isinstance(e, TextDelta) else None)
        return out

    expected = [entries_alone(p) for p in wanted]
    got: list[list] = [[] for _ in wanted]
    seqs = [Sequence(lm, p, make_prompt_cache(lm.model),
                     emit=lambda e, i=i: got[i].extend(e.logprobs) if isinstance(e, TextDelta) else None)
            for i, p in enumerate(wanted)]
    together(lm, seqs, joins_at={3: 3})
    for mine, theirs in zip(got, expected):
        assert [e.token for e in mine] == [e.token for e in theirs] and len(mine) > 1
        assert [e.logprob for e in mine] == pytest.approx([e.logprob for e in theirs], abs=1e-3)
        assert [a.logprob for e in mine for a in e.top] == pytest.approx([a.logprob for e in theirs for a in e.top],
                                                                     abs=1e-3)
