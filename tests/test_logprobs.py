"""Token logprobs on every route: Chat, text completions (echo included), Responses and
LMSP's extension. Each figure is the model's own: the log-softmax of its raw logits, checked
against one pass of the model over the prompt and the reply, and the tokens listed join to
exactly the text returned, whatever batching, speculation, markup or stop sequences did."""

from __future__ import annotations

import json
import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tool_parsers import json_tools
from tests.helpers import HTTP, read_sse

from lmsp_mlx.engine.events import TextDelta
from lmsp_mlx.engine.batch import generate
from lmsp_mlx.engine.generate import GenerationParams, Penalties
from lmsp_mlx.engine.loader import load_model
from lmsp_mlx.engine.output import DEFAULT_CALL, OutputFormat, OutputParser
from lmsp_mlx.engine.speculate import DraftModel, Drafting
from lmsp_mlx.protocol.logprobs import LogprobLedger, TokenLogprob
from lmsp_mlx.service.stops import StopScanner

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox jumps over the lazy dog. Count these tokens"
TOL = 2e-3  # a decode step's logits against one pass over the same tokens (float32, other matmul shapes)


@pytest.fixture(scope="module")
def sdk(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    return load_model(tiny_model_dir)


def model_logprobs(lm, tokens: list[int]) -> mx.array:
    """The model's log-softmax after each of `tokens` (len, vocab), from one pass."""
    logits = lm.model(mx.array([tokens]), cache=make_prompt_cache(lm.model))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def greedy(lm, prompt: list[int], n: int) -> list[int]:
    """The model's n likeliest next tokens in turn, end of turn or not."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(mx.argmax(model_logprobs(lm, tokens)[-1]).item())
    return tokens[len(prompt):]


def check_against_the_model(lm, prompt: list[int], reply: list[int], logprobs: list[float], tops: list[dict], k: int):
    """Each reply token's logprob is the model's, and its alternatives are the model's likeliest."""
    lp = model_logprobs(lm, prompt + reply)
    for i, (token, got) in enumerate(zip(reply, logprobs)):
        row = lp[len(prompt) - 1 + i]
        assert abs(row[token].item() - got) < TOL, (i, row[token].item(), got)
        best = sorted(row.tolist(), reverse=True)[:k]
        # (two tokens with the same text are one key of a completion's dict: the values are among the best)
        assert all(min(abs(v - b) for b in best) < TOL for v in tops[i].values())


def test_text_completion_logprobs_are_the_models_and_join_to_the_text(sdk, tiny_lm):
    done = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    choice = done.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == done.usage.completion_tokens == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    prompt = tiny_lm.tokenizer.encode(PROMPT)
    reply = greedy(tiny_lm, prompt, 8)
    check_against_the_model(tiny_lm, prompt, reply, lp.token_logprobs, lp.top_logprobs, 3)
    for i, top in enumerate(lp.top_logprobs):  # greedy: the token taken is the likeliest
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-5)
    streamed = list(sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                           stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_echo_scores_the_prompt_as_lm_eval_harness_asks(sdk, tiny_lm):
    """loglikelihood requests: echo, logprobs and max_tokens 0 (or 1)."""
    done = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, temperature=0, logprobs=1, echo=True)
    lp = done.choices[0].logprobs
    prompt = tiny_lm.tokenizer.encode(PROMPT)
    assert done.choices[0].text == PROMPT == "".join(lp.tokens) and len(lp.tokens) == len(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    full = model_logprobs(tiny_lm, prompt)
    for i in range(1, len(prompt)):
        assert abs(full[i - 1][prompt[i]].item() - lp.token_logprobs[i]) < TOL
        assert len(lp.top_logprobs[i]) == 1
    # A prompt the KV pool holds still scores every token; one more token follows the prompt's.
    again = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    both = again.choices[0].logprobs
    assert both.token_logprobs[0] is None
    assert both.token_logprobs[1: len(prompt)] == pytest.approx(lp.token_logprobs[1:], abs=TOL)
    assert len(both.tokens) == len(prompt) + 1 and "".join(both.tokens) == again.choices[0].text
    streamed = list(sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, logprobs=1, echo=True,
                                           stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT


def test_several_prompts_are_a_choice_each_as_lm_eval_harness_batches_them(sdk):
    """lm-eval-harness with --batch_size above 1: one request, a list of prompts, a choice
    for each (in prompt order), each what that prompt alone gets."""
    prompts = [PROMPT, "Hello there, general", "One two three four"]
    alone = [sdk.completions.create(model="tiny", prompt=p, max_tokens=1, temperature=0, logprobs=1, echo=True)
             for p in prompts]
    batched = sdk.completions.create(model="tiny", prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert [c.index for c in batched.choices] == [0, 1, 2]
    for c, one in zip(batched.choices, alone):
        assert c.text == one.choices[0].text and c.logprobs.tokens == one.choices[0].logprobs.tokens
        assert c.logprobs.token_logprobs[1:] == pytest.approx(one.choices[0].logprobs.token_logprobs[1:], abs=TOL)
    assert batched.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batched.usage.completion_tokens == 3
    streamed = list(sdk.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts = {i: "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in range(3)}
    sync = sdk.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert texts == {c.index: c.text for c in sync.choices}
    assert streamed[-1].usage.completion_tokens == 12
    assert sorted(c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason) == \
        ["length"] * 3


def test_chat_logprobs_with_top_alternatives_sync_and_streamed(sdk, tiny_lm):
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Say something."}], max_tokens=10, temperature=0,
               logprobs=True, top_logprobs=4)
    done = sdk.chat.completions.create(**ask)
    content = done.choices[0].logprobs.content
    assert "".join(e.token for e in content) == done.choices[0].message.content
    assert all(len(e.top_logprobs) == 4 for e in content)
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5) for e in content)  # greedy
    chunks = list(sdk.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = sdk.chat.completions.create(**{k: v for k, v in ask.items() if "logprobs" not in k})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == done.choices[0].message.content


def test_logprobs_are_the_raw_distributions_whatever_the_sampling(tiny_lm):
    """vLLM's default: before temperature, penalties and logit_bias."""
    prompt = tiny_lm.tokenizer.encode(PROMPT)
    sampled: list[int] = []
    out: list[TokenLogprob] = []
    params = GenerationParams(prompt, 6, temperature=1.8, seed=7, logprobs=2, ignore_eos=True,
                              penalties=Penalties(presence=1.5, bias=((5, 3.0),)))
    generate(tiny_lm, params, lambda e: out.extend(e.logprobs) if isinstance(e, TextDelta) else None, sampled=sampled)
    assert len(out) == len(sampled) == 6
    check_against_the_model(tiny_lm, prompt, sampled, [e.logprob for e in out], [{a.token: a.logprob for a in e.top} for e in out], 2)


def test_responses_and_lmsp_return_logprobs_on_request(tiny_server, sdk):
    done = sdk.responses.create(model="tiny", input="Say something.", max_output_tokens=8, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2)
    part = done.output[-1].content[0]
    assert "".join(e.token for e in part.logprobs) == part.text and part.logprobs
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)
    events = list(sdk.responses.create(model="tiny", input="Say something.", max_output_tokens=8, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=2, stream=True))
    deltas = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert [e.token for e in deltas] == [e.token for e in part.logprobs]
    plain = sdk.responses.create(model="tiny", input="Say something.", max_output_tokens=8, temperature=0)
    assert plain.output[-1].content[0].logprobs == []
    # LMSP: an extension, in the text deltas and the message's part.
    body = {"model": "tiny", "input": "Say something.", "max_output_tokens": 8, "temperature": 0,
            "extensions": {"logprobs": 1}}
    r = HTTP.post(tiny_server.url + "/lmsp/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    part = r.json()["output"][-1]["content"][0]
    assert "".join(e["token"] for e in part["logprobs"]) == part["text"]
    with HTTP.stream("POST", tiny_server.url + "/lmsp/v1/responses", json={**body, "stream": True}, timeout=60) as s:
        frames = read_sse(s.iter_lines())
    streamed = [e for f in frames if f.get("event") == "response.output_text.delta" for e in f["data"]["logprobs"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in part["logprobs"]]
    r = HTTP.post(tiny_server.url + "/lmsp/v1/responses", json={**body, "extensions": {}}, timeout=60)
    assert "logprobs" not in r.json()["output"][-1]["content"][0]  # LMSP's item as section 6.2 has it


def test_batched_requests_get_the_logprobs_they_get_alone(sdk):
    prompts = [f"Story number {i}: once upon a time" for i in range(4)]

    def one(prompt):
        r = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True})
        return r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs

    alone = [one(p) for p in prompts]
    together: list = [None] * 4
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, one(prompts[i]))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (tokens, lps), (tokens2, lps2) in zip(alone, together):
        assert tokens == tokens2 and lps2 == pytest.approx(lps, abs=TOL)


def test_verified_drafts_give_the_logprobs_plain_decoding_gives(tiny_lm):
    prompt = tiny_lm.tokenizer.encode(PROMPT)

    def entries(drafting):
        out: list[TokenLogprob] = []
        emit = lambda e: out.extend(e.logprobs) if isinstance(e, TextDelta) else None  # noqa: E731
        generate(tiny_lm, GenerationParams(prompt, 12, temperature=0.0, logprobs=2, ignore_eos=True), emit,
                 drafting=drafting)
        return out

    plain = entries(None)
    drafted = entries(Drafting(4, drafter=DraftModel(tiny_lm)))  # the model as its own draft: every draft accepted
    assert len(plain) == len(drafted) == 12
    assert [e.token for e in drafted] == [e.token for e in plain]
    assert [e.logprob for e in drafted] == pytest.approx([e.logprob for e in plain], abs=TOL)


def test_markup_reasoning_and_stop_sequences_keep_the_tokens_joined_to_the_text():
    """The parser hands out each token once, with the part of its text the client sees."""
    parser = OutputParser(OutputFormat(("<think>", "</think>"), DEFAULT_CALL, json_tools.parse_tool_call), tools=None)
    pieces = ["<think>", "hm", "</think>", "Hel", "lo <", "b> there"]
    out = []
    for p in pieces:
        out += parser.feed(p, (TokenLogprob(p, -1.0),))
    out += parser.finish()
    text = "".join(e.text for e in out if isinstance(e, TextDelta))
    entries = [e for d in out if isinstance(d, TextDelta) for e in d.logprobs]
    assert text == "Hello <b> there" == "".join(e.token for e in entries)
    assert len(entries) == 3  # "Hel", "lo <", "b> there": the reasoning's tokens are not listed
    scanner = StopScanner(["<b"])
    shown, stopped = scanner.feed("Hello <b> there", tuple(entries))
    assert stopped and shown == "Hello " == "".join(e.token for e in scanner.logprobs)


def test_a_ledger_hands_out_zero_width_tokens_where_they_fall():
    ledger = LogprobLedger()
    ledger.add([TokenLogprob("ab", -1), TokenLogprob("", -2), TokenLogprob("cd", -3)])
    assert [e.token for e in ledger.shown(0, 3)] == ["ab", ""]
    assert [e.token for e in ledger.shown(3, 4)] == ["cd"] and not ledger.rest()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/responses", {"input": "hi", "top_logprobs": 21}, "top_logprobs"),
    ("/lmsp/v1/responses", {"input": "hi", "extensions": {"logprobs": 21}}, "extensions.logprobs"),
])
def test_bad_logprob_settings_are_400s_naming_the_field(tiny_server, path, body, param):
    r = HTTP.post(tiny_server.url + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    problem = r.json()
    assert (problem.get("error", {}).get("param") or problem.get("param")) == param, json.dumps(problem)


def test_a_token_that_is_part_of_a_character_has_its_own_bytes(tiny_lm):
    """Byte-level pieces of a character: the alternatives say which bytes (OpenAI's
    `bytes:\\x..` text), not U+FFFD, and a reply's bytes join to its text's."""
    from lmsp_mlx.engine.logprobs import alternative, token_bytes

    tok = tiny_lm.tokenizer
    lead = tok.convert_tokens_to_ids("ð")  # byte 0xF0 in the byte-level alphabet: a 4-byte character's first
    assert tok.decode([lead]) == "\ufffd" and token_bytes(tok, lead) == b"\xf0"
    alt = alternative(tok, lead, -1.0)
    assert alt.token == "bytes:\\xf0" and alt.bytes == b"\xf0"
    space = tok.convert_tokens_to_ids("Ġ")
    assert token_bytes(tok, space) is None and alternative(tok, space, -1.0).token == " "
    # "😀" is F0 9F 98 80: four byte tokens; the last carries the character, the bytes each their own.
    pieces = [tok.convert_tokens_to_ids(c) for c in "ðŁĺĢ"]
    out: list[TokenLogprob] = []
    params = GenerationParams(tok.encode(PROMPT), 4, temperature=0.0, logprobs=1, ignore_eos=True,
                              penalties=Penalties(bias=tuple((p, 0.0) for p in pieces)))
    forced = iter(pieces)

    class Forced:  # the reply is the four pieces, whatever the model would say
        def forced(self):
            return next(forced, None)

        def saw(self, token):
            pass

    seq_events: list = []
    from lmsp_mlx.engine.sequence import Sequence
    seq = Sequence(tiny_lm, params, make_prompt_cache(tiny_lm.model), seq_events.append)
    seq.sampler.budget = Forced()
    from lmsp_mlx.engine.batch import Batch
    batch = Batch(tiny_lm)
    while seq.result is None:
        if seq.to_prefill:
            seq.prefill_chunk(256)
        else:
            assert batch.step([seq]) == {}
    out = [e for ev in seq_events if isinstance(ev, TextDelta) for e in ev.logprobs]
    text = "".join(ev.text for ev in seq_events if isinstance(ev, TextDelta))
    assert text == "😀" == "".join(e.token for e in out) and [e.token for e in out] == ["", "", "", "😀"]
    assert b"".join(e.bytes for e in out) == "😀".encode() and [len(e.bytes) for e in out] == [1, 1, 1, 1]


@pytest.mark.slow
def test_the_default_model_writes_an_emoji_whose_bytes_join(default_server):
    """Real text split into byte pieces: the tokens join to the content, their own bytes to
    its bytes, and no alternative reads U+FFFD."""
    real = openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    done = real.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=12, logprobs=True, top_logprobs=3,
        messages=[{"role": "user", "content": "Reply with a smiley emoji 😀 and the word hello."}])
    content, entries = done.choices[0].message.content, done.choices[0].logprobs.content
    assert any(ord(c) > 0xFFFF for c in content)  # an emoji came back: four bytes, several tokens
    assert "".join(e.token for e in entries) == content
    assert bytes(b for e in entries for b in e.bytes) == content.encode()
    assert all(a.token != "\ufffd" for e in entries for a in e.top_logprobs)
