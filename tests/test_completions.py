"""POST /v1/completions: the prompt continued as it is, through the OpenAI SDK."""

from __future__ import annotations

import mlx.core as mx
import pytest
from tests.helpers import HTTP, lookups_during
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from lmsp_mlx.engine.loader import load_model

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox jumps over the lazy dog. Count these tokens"


@pytest.fixture(scope="module")
def sdk(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    return load_model(tiny_model_dir)


def greedy_by_mlx_lm(lm, prompt: str, n: int) -> tuple[list[int], bool]:
    """mlx-lm's own decode loop over the raw prompt tokens (no chat template), up to the
    end of turn; and whether it ended there."""
    tokens = lm.tokenizer.encode(prompt)
    out = []
    for t, _ in generate_step(mx.array(tokens), lm.model, prompt_cache=make_prompt_cache(lm.model),
                              sampler=lambda logprobs: mx.argmax(logprobs, axis=-1), max_tokens=n):
        if t in lm.eos_token_ids:
            return out, True
        out.append(t)
    return out, False


def test_the_prompt_is_continued_as_it_is(sdk, tiny_lm):
    expected, ended = greedy_by_mlx_lm(tiny_lm, PROMPT, 16)
    assert len(expected) >= 4  # enough text to compare
    done = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    assert done.object == "text_completion" and len(done.choices) == 1
    choice = done.choices[0]
    ids = tiny_lm.tokenizer.encode(PROMPT)  # the text continues the prompt's (a leading space kept)
    whole = tiny_lm.tokenizer.decode(ids + expected, skip_special_tokens=True)
    assert choice.text == whole[len(tiny_lm.tokenizer.decode(ids, skip_special_tokens=True)):]
    assert choice.finish_reason == ("stop" if ended else "length")
    assert done.usage.prompt_tokens == len(tiny_lm.tokenizer.encode(PROMPT))
    assert done.usage.completion_tokens == len(expected)
    # The same prompt as token ids, and in OpenAI's one-element batch forms.
    ids = tiny_lm.tokenizer.encode(PROMPT)
    for prompt in (ids, [PROMPT], [ids]):
        assert sdk.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0).choices[0].text \
            == choice.text
    assert ended  # this prompt's reply ends its turn: vLLM's ignore_eos goes on to a benchmark's fixed length
    longer = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=len(expected) + 4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == len(expected) + 4 and longer.choices[0].finish_reason == "length"
    assert longer.choices[0].text.startswith(choice.text)
    echoed = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + choice.text


def test_a_stream_gives_the_same_text_then_usage(sdk, tiny_server):
    sync = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    chunks = []
    sources = lookups_during(tiny_server, lambda: chunks.extend(sdk.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True})))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == sync.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == sync.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    # A repeated prompt reuses the KV its first request left.
    assert sources == {"token": 1} and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_a_stop_sequence_ends_the_text_before_it(sdk):
    whole = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = whole[4:6]
    assert len(stop) == 2
    cut = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[: whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_what_is_not_served_is_refused_with_its_param(tiny_server, tiny_lm):
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    for fields, status, param in [
        ({"prompt": ["one"] * 65}, 400, "prompt"), ({"prompt": ""}, 400, "prompt"), ({"prompt": 5}, 400, "prompt"),
        ({"prompt": [tiny_lm.vocab_size]}, 400, "prompt"), ({"logprobs": 21}, 400, "logprobs"),
        ({"suffix": "end"}, 400, "suffix"), ({"n": 2}, 400, "n"), ({"max_tokens": -1}, 400, "max_tokens"),
        ({"model": "other"}, 404, "model"), ({"temperature": 3}, 400, "temperature"),
        ({"logit_bias": {"999999": 1}}, 400, "logit_bias"), ({"prompt": "x " * 40000}, 400, "prompt"),
        ({"stop": ["s"] * 17}, 400, "stop"), ({"stop": 5}, 400, "stop"), ({"stop": "s" * 257}, 400, "stop"),
    ]:
        r = HTTP.post(tiny_server.url + "/v1/completions", json={**base, **fields}, timeout=60)
        assert r.status_code == status and r.json()["error"]["param"] == param, (fields, r.text)


@pytest.mark.slow
def test_the_default_model_completes_a_plain_sentence(default_server):
    real = openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    done = real.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=4,
                                   temperature=0)
    assert done.choices[0].text.startswith(" Paris")  # continued as text (its space kept), not answered as a chat turn
    echoed = real.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=4,
                                     temperature=0, echo=True, stop=[" Paris"])
    assert echoed.choices[0].text == "The capital of France is" and echoed.choices[0].finish_reason == "stop"


def test_special_tokens_have_no_text_in_a_completion(sdk, tiny_lm):
    start = tiny_lm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert start in tiny_lm.special_token_ids and start not in tiny_lm.eos_token_ids
    done = sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(start): 100})
    assert done.choices[0].text == "" and done.usage.completion_tokens == 3  # sampled, counted, not shown
