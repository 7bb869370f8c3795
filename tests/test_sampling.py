"""Sampling settings beyond temperature: OpenAI's presence/frequency penalties and seed."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from lmsp_mlx.engine.batch import generate
from lmsp_mlx.engine.generate import GenerationParams, Penalties
from lmsp_mlx.engine.loader import load_model
from tests.tiny_model import ENDLESS
from tests.helpers import HTTP


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    return load_model(tiny_model_dir)


def greedy(lm, prompt: list[int], n: int, penalties: Penalties | None) -> list[int]:
    sampled: list[int] = []
    generate(lm, GenerationParams(prompt=prompt, max_tokens=n, temperature=0.0, penalties=penalties),
             emit=lambda e: None, cancelled=lambda: False, sampled=sampled)
    return sampled


def penalized_by_hand(lm, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """OpenAI's formula written out: logit - frequency * count - presence * (count > 0)."""
    cache = make_prompt_cache(lm.model)
    logits = lm.model(mx.array([prompt]), cache=cache)[0, -1]
    out: list[int] = []
    while len(out) < n:
        scores = np.array(logits.astype(mx.float32))
        for token, count in Counter(out).items():
            scores[token] -= frequency * count + presence
        token = int(np.argmax(scores))
        out.append(token)
        if token in lm.eos_token_ids:
            break
        logits = lm.model(mx.array([[token]]), cache=cache)[0, -1]
    return out


def test_penalties_lower_the_logits_of_tokens_the_reply_already_holds(tiny_lm):
    prompt = tiny_lm.tokenizer.encode(ENDLESS)
    plain = greedy(tiny_lm, prompt, 16, None)
    assert len(set(plain)) < len(plain)  # this model repeats itself when greedy
    for presence, frequency in [(0.0, 1.5), (1.5, 0.0), (0.4, 0.9), (-0.5, 0.0)]:
        got = greedy(tiny_lm, prompt, 16, Penalties(presence, frequency))
        # Tokens 1-2 are sampled before generate_step, the rest inside it: both count.
        assert got == penalized_by_hand(tiny_lm, prompt, 16, presence, frequency), (presence, frequency)
    assert greedy(tiny_lm, prompt, 16, Penalties(1.5, 1.5)) != plain


def test_logit_bias_is_added_to_the_logits_of_its_tokens(tiny_lm):
    prompt = tiny_lm.tokenizer.encode(ENDLESS)
    plain = greedy(tiny_lm, prompt, 8, None)
    [a] = tiny_lm.tokenizer.encode("a")
    assert greedy(tiny_lm, prompt, 8, Penalties(bias=((a, 100.0),))) == [a] * 8
    banned = greedy(tiny_lm, prompt, 8, Penalties(bias=((plain[0], -100.0),)))
    assert plain[0] not in banned
    both = Penalties(presence=1.0, bias=((plain[0], -100.0),))  # with the penalties, in one shift
    assert greedy(tiny_lm, prompt, 8, both)[0] == banned[0]


def sampled(lm, prompt: list[int], seed: int | None) -> list[int]:
    """A hot, penalized reply: this model's own distribution is too peaked to tell keys apart."""
    out: list[int] = []
    generate(lm, GenerationParams(prompt=prompt, max_tokens=24, temperature=2.0, seed=seed,
                                  penalties=Penalties(0.0, 2.0)),
             emit=lambda e: None, cancelled=lambda: False, sampled=out)
    return out


def test_a_seed_fixes_the_reply_and_hands_the_random_key_back(tiny_lm):
    prompt = tiny_lm.tokenizer.encode(ENDLESS)
    first = sampled(tiny_lm, prompt, 42)
    assert sampled(tiny_lm, prompt, 42) == first
    assert sampled(tiny_lm, prompt, 43) != first
    assert sampled(tiny_lm, prompt, -1) == sampled(tiny_lm, prompt, 2**64 - 1)  # one 64-bit seed, as OpenAI's
    mx.random.seed(5)
    unseeded = sampled(tiny_lm, prompt, None)
    mx.random.seed(5)
    sampled(tiny_lm, prompt, 42)
    assert sampled(tiny_lm, prompt, None) == unseeded  # as if the seeded reply had not run


def chat(server, **fields) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": ENDLESS}], "max_tokens": 24,
            "temperature": 1.0, **fields}
    r = HTTP.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_chat_and_responses_take_seed_penalties_and_logit_bias(tiny_server, tiny_model_dir):
    hot = {"temperature": 2.0, "frequency_penalty": 2.0}
    assert chat(tiny_server, seed=42, **hot) == chat(tiny_server, seed=42, **hot)
    r = HTTP.post(tiny_server.url + "/v1/responses", timeout=120,  # the same settings on /v1/responses
                   json={"model": "tiny", "input": ENDLESS, "max_output_tokens": 12, "temperature": 1.0, "seed": 42,
                         "frequency_penalty": 0.5, "store": False})
    assert r.status_code == 200 and r.json()["frequency_penalty"] == 0.5
    [a] = load_model(tiny_model_dir).tokenizer.encode("a")
    assert chat(tiny_server, logit_bias={str(a): 100}, max_tokens=5) == "aaaaa"
    for field, value in [("seed", 2**64), ("seed", 1.5), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}),
                         ("logit_bias", {"99999": 1}), ("logit_bias", [1])]:
        bad = HTTP.post(tiny_server.url + "/v1/chat/completions", timeout=60,
                         json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith(field), (field, value, bad.text)
