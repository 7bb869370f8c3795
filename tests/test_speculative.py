"""Speculative decoding (engine/speculate.py): a sequence drafts tokens, one step verifies
them, and the reply is the one decoding without speculation gives.

Tolerance: none on tokens. On the compiled CPU step a draft's rows are computed as that
step computes any row, so the logits are bitwise those of one token at a time. Through MLX
(every other family, and llama with the compiled step off) a step of several rows may sum
in another order than a step of one; the tiny models' output heads are scaled so that
greedy choices have no near-tie, and each test here checks tokens, not logits.
"""

from __future__ import annotations

import math
import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from lmsp_mlx.engine.batch import Batch, chunk_size, generate, next_prefill
from lmsp_mlx.engine.generate import GenerationParams
from lmsp_mlx.engine.loader import load_model
from lmsp_mlx.engine.sequence import Phase, Sequence
from lmsp_mlx.engine.speculate import LONGEST_PAUSE, DraftModel, Drafting, PromptLookup, rollback_plan, same_tokenizer
from tests.helpers import HTTP
from tests.test_families import on_the_mlx_runner, params
from tests.tiny_model import FAMILIES, build_tiny_family_model, first_layers, write_tokenizer

# -- the drafter and its adaptation --------------------------------------------------------------


def test_prompt_lookup_drafts_what_followed_the_longest_recent_match():
    lookup = PromptLookup()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 2, 3, 4]
    # "2 3 4" ended twice before; the latest occurrence was followed by 6 7 8.
    assert lookup.draft(tokens, 3) == [6, 7, 8]
    assert lookup.draft(tokens, 10) == [6, 7, 8, 2, 3, 4]  # up to the end of what is known
    assert lookup.draft([*tokens, 5, 1], 2) == []  # "5 1" and "1" alone: no 2-gram seen before
    assert lookup.draft([*tokens, 6, 7], 2) == [8, 2]  # the index grew with the tokens


def test_drafting_adapts_its_length_and_pauses_after_refused_drafts():
    d = Drafting(max_draft=6)
    d.k = 3
    d.settle(drafted=3, accepted=3)
    assert d.k == 4  # all accepted: one more next time
    d.settle(drafted=4, accepted=1)
    assert d.k == 2  # what was accepted, plus one
    d.settle(drafted=2, accepted=0)
    assert d.paused == 0 and d.k == 1  # one miss: no pause yet
    d.settle(drafted=1, accepted=0)
    assert d.paused == 2  # a second miss in a row pauses
    assert d.draft([1, 2, 1, 2], 5) == [] and d.draft([1, 2, 1, 2], 5) == [] and d.paused == 0
    assert d.draft([1, 2, 1, 2], 5) == [1]  # drafting again, at the adapted length
    for _ in range(20):
        d.settle(drafted=1, accepted=0)
    assert d.paused == LONGEST_PAUSE
    assert (d.drafted, d.accepted) == (10 + 20, 4)


# -- exact tokens on every family ---------------------------------------------------------------


class Oracle:
    """Drafts the reference reply's next tokens (all accepted), or with `wrong_last` the same
    with its last token changed (all but the last accepted: every step rolls back a row)."""

    def __init__(self, prompt: list[int], reference: list[int], wrong_last: bool = False) -> None:
        self.prompt, self.reference, self.wrong_last = prompt, reference, wrong_last

    def draft(self, tokens: list[int], k: int) -> list[int]:
        done = len(tokens) - len(self.prompt)
        draft = self.reference[done : done + k]
        if self.wrong_last and draft:
            draft[-1] = 5 + (draft[-1] + 1) % 200
        return draft


def reply(lm, p: GenerationParams, drafting: Drafting | None = None) -> list[int]:
    sampled: list[int] = []
    generate(lm, p, emit=lambda e: None, sampled=sampled, drafting=drafting)
    return sampled


@pytest.fixture(scope="module", params=("llama-compiled", *FAMILIES))
def any_lm(request, tmp_path_factory):
    """Every family on the MLX runner, and llama on the compiled CPU runner."""
    arch = request.param.removesuffix("-compiled")
    path = build_tiny_family_model(tmp_path_factory.mktemp(arch) / arch, arch)
    if request.param.endswith("-compiled"):
        lm = load_model(path)
        assert lm.runner.kind == "compiled-cpu"
        return lm
    patch = on_the_mlx_runner()
    try:
        return load_model(path)
    finally:
        patch.undo()


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_verified_drafts_give_the_tokens_decoding_without_them_gives(any_lm, sampling):
    """Drafts that are all right, drafts whose last token is wrong (a rollback every step:
    a trim, or for recurrent and full sliding-window layers their state put back and the
    accepted tokens run again), and prompt lookup: the same tokens as no speculation, greedy
    or seeded. The prompt (40 tokens) is longer than the sliding window (16)."""
    lm = any_lm
    p = GenerationParams(**{**params(lm)[0].__dict__, "max_tokens": 24, **sampling})
    expected = reply(lm, p)
    for wrong_last in (False, True):
        drafting = Drafting(4, drafter=Oracle(p.prompt, expected, wrong_last))
        assert reply(lm, p, drafting) == expected, f"wrong_last={wrong_last}"
        assert drafting.accepted > 0 and (drafting.accepted < drafting.drafted) == wrong_last
    lookup = Drafting(4)
    assert reply(lm, p, lookup) == expected


def test_all_accepted_drafts_take_a_step_for_several_tokens(any_lm):
    lm = any_lm
    p = GenerationParams(**{**params(lm)[0].__dict__, "max_tokens": 25, "temperature": 0.0})
    expected = reply(lm, p)
    seq = Sequence(lm, p, make_prompt_cache(lm.model), emit=lambda e: None,
                   drafting=Drafting(4, drafter=Oracle(p.prompt, expected)))
    batch, steps = Batch(lm), 0
    while seq.phase is not Phase.DONE:
        if seq.phase is Phase.PREFILL:
            seq.prefill_chunk(64)
            continue
        assert batch.step([seq]) == {}
        steps += 1
    assert seq.sampled == expected
    assert steps <= 8  # 25 tokens, up to 5 a step once k has grown to 4 (no speculation: 24 or 25 steps)


def test_the_compiled_batched_step_verifies_each_sequences_draft_beside_the_others(tmp_path):
    """Four sequences in the compiled batched step, each with drafts of its own length (one
    drafts nothing): each gets its tokens alone, and a draft's rows cost no extra pass."""
    lm = load_model(build_tiny_family_model(tmp_path / "llama", "llama"))
    assert lm.runner.batch is not None
    ps = [GenerationParams(**{**p.__dict__, "max_tokens": 20}) for p in params(lm)]
    expected = [reply(lm, p) for p in ps]
    draftings = [Drafting(4, drafter=Oracle(p.prompt, e, wrong_last=i == 2)) for i, (p, e) in
                 enumerate(zip(ps, expected))]
    draftings[1] = None
    seqs = [Sequence(lm, p, make_prompt_cache(lm.model), emit=lambda e: None, drafting=d)
            for p, d in zip(ps, draftings)]
    batch = Batch(lm)
    while live := [s for s in seqs if s.phase is not Phase.DONE]:
        if (s := next_prefill(live)) is not None:
            s.prefill_chunk(chunk_size(s, 64, True))
        decoding = [s for s in live if s.phase is Phase.DECODE]
        if decoding:
            assert batch.step(decoding) == {}
    assert [s.sampled for s in seqs] == expected
    assert all(d.accepted > 0 for d in draftings if d is not None)


def test_a_rotating_cache_trims_until_its_window_fills_then_reruns():
    from mlx_lm.models.cache import RotatingKVCache

    c = RotatingKVCache(max_size=16)
    c.update_and_fetch(mx.zeros((1, 1, 10, 4)), mx.zeros((1, 1, 10, 4)))
    assert rollback_plan([c], 5) == "trim" and rollback_plan([c], 7) == "rerun"


# -- a draft model ------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_a_draft_model_gives_the_tokens_decoding_without_it_gives(any_lm, sampling):
    """The model as its own draft model, on every family: its drafts are its own greedy
    tokens, verified as any draft. Seeded sampling refuses some of them: the draft model's
    cache trims them away, or, where it has recurrent layers, starts over from the prompt."""
    lm = any_lm
    p = GenerationParams(**{**params(lm)[0].__dict__, "max_tokens": 24, **sampling})
    expected = reply(lm, p)
    drafting = Drafting(4, drafter=DraftModel(lm))
    assert reply(lm, p, drafting) == expected
    assert drafting.accepted > 0
    if lm.runner.kind == "compiled-cpu" and p.temperature == 0:  # the same rows, bitwise: every draft is right
        assert drafting.accepted == drafting.drafted


@pytest.fixture(scope="module")
def llama_with_draft(tmp_path_factory):
    """A tiny llama (4 layers) and a copy of its first 3 layers: a draft model that is often, not always, right."""
    folder = tmp_path_factory.mktemp("draft")
    path = build_tiny_family_model(folder / "llama", "llama")
    return path, first_layers(path, folder / "llama-3-layers", 3)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_a_smaller_draft_model_is_verified_token_by_token(llama_with_draft, sampling):
    path, small = llama_with_draft
    lm, draft = load_model(path), load_model(small)
    for p in params(lm):
        p = GenerationParams(**{**p.__dict__, "max_tokens": 30, **sampling})
        drafting = Drafting(4, drafter=DraftModel(draft))
        assert reply(lm, p, drafting) == reply(lm, p)
        assert drafting.drafted > 0


def test_a_draft_model_must_share_the_models_tokenizer(llama_with_draft, tmp_path):
    path, small = llama_with_draft
    lm = load_model(path)
    assert same_tokenizer(lm, load_model(small)) is None
    other = first_layers(path, tmp_path / "other", 3)
    write_tokenizer(other, words=("speculation",))  # one token more
    why = same_tokenizer(lm, load_model(other))
    assert why is not None and "vocabulary" in why


# -- the distribution of sampled tokens -----------------------------------------------------------


def chi_square(counts: dict[int, int], probs: mx.array, n: int) -> tuple[float, int]:
    """Pearson's statistic over the tokens expected at least 5 times, the rest pooled."""
    probs = probs.tolist()
    big = [t for t, q in enumerate(probs) if q * n >= 5]
    stat = sum((counts.get(t, 0) - probs[t] * n) ** 2 / (probs[t] * n) for t in big)
    rest_p = 1 - sum(probs[t] for t in big)
    if rest_p * n >= 5:
        rest = n - sum(counts.get(t, 0) for t in big)
        stat += (rest - rest_p * n) ** 2 / (rest_p * n)
        return stat, len(big)
    return stat, len(big) - 1


TEMPERATURE = 8.0


@pytest.mark.parametrize("drafter", ["second-likeliest", "draft-model"])
def test_a_draft_leaves_the_sampled_distribution_as_it_is(llama_with_draft, drafter):
    """Unseeded sampling with a draft of one token every time: the token the model likes
    second best, or a draft model's (the model's first 3 layers) greedy token. The first
    token follows the model's own distribution, and so does the token after an accepted
    draft (drawn from the draft's row). Pearson's chi-square against the model's
    probabilities, 1,200 replies, at the 0.1% level (the random state is seeded by
    conftest.py). Temperature 8 spreads the tiny model's sharp head over a dozen tokens."""
    path, small = llama_with_draft
    lm = load_model(path)
    prompt = params(lm)[0].prompt
    cache = make_prompt_cache(lm.model)
    first = mx.softmax(lm.runner.last_logits(prompt, cache)[0] / TEMPERATURE)
    if drafter == "draft-model":
        draft = load_model(small)
        drafted = DraftModel(draft).draft(prompt, 1)[0]
        new_drafter = lambda: DraftModel(draft)  # noqa: E731  (a fresh draft cache for each reply)
    else:
        drafted = int(mx.argsort(first)[-2].item())

        class Fixed:
            def draft(self, tokens: list[int], k: int) -> list[int]:
                return [drafted]

        new_drafter = Fixed

    n, firsts, seconds = 1200, {}, {}
    for _ in range(n):
        got = reply(lm, GenerationParams(prompt=prompt, max_tokens=2, temperature=TEMPERATURE),
                    Drafting(1, drafter=new_drafter()))
        firsts[got[0]] = firsts.get(got[0], 0) + 1
        if got[0] == drafted:
            seconds[got[1]] = seconds.get(got[1], 0) + 1
    stat, dof = chi_square(firsts, first, n)
    assert stat < chi_square_999(dof), (stat, dof)
    cache = make_prompt_cache(lm.model)
    after = mx.softmax(lm.runner.last_logits([*prompt, drafted], cache)[0] / TEMPERATURE)
    m = sum(seconds.values())
    assert m > 100  # the draft was a likely token: accepted often enough to test
    stat, dof = chi_square(seconds, after, m)
    assert stat < chi_square_999(dof), (stat, dof)


def chi_square_999(dof: int) -> float:
    """The chi-square distribution's 99.9th percentile (Wilson-Hilferty)."""
    z = 3.090
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


# -- through the server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def speculating(start_module_server, tmp_path_factory):
    """A tiny llama on the compiled CPU runner with --speculate ngram; a request can turn it off."""
    path = build_tiny_family_model(tmp_path_factory.mktemp("llama") / "llama", "llama")
    return start_module_server("--model", str(path), "--model-id", "m", "--no-kv-disk", "--max-batch", "4",
                               "--speculate", "ngram")


def complete(server, prompt: list[int], max_tokens: int, speculate: bool, **extra) -> dict:
    r = HTTP.post(server.url + "/v1/completions", timeout=120, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "speculate": speculate, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def cycling_prompt(n: int, at: int) -> list[int]:
    return [(at + 7 * i) % 250 + 5 for i in range(n)]


def speculates_like_decoding_alone(server, bodies: list[tuple[list[int], int]], drafter: str) -> None:
    """The bodies at once with speculation give the texts each gets alone without it; the
    log and /metrics show the drafter's drafts."""
    expected = [complete(server, *b, speculate=False)["choices"][0]["text"] for b in bodies]
    got: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(
        i, complete(server, *bodies[i], speculate=True)["choices"][0]["text"])) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got[i] for i in range(len(bodies))] == expected
    assert "speculation=" in server.log()
    metrics = HTTP.get(server.url + "/metrics").text
    drafted = next(line for line in metrics.splitlines() if line.startswith("lmsp_speculative_drafted_tokens_total{"))
    assert drafted.startswith(f'lmsp_speculative_drafted_tokens_total{{drafter="{drafter}"}}')
    assert int(drafted.split()[-1]) > 0


def test_concurrent_requests_get_the_tokens_they_get_without_speculation(speculating):
    bodies = [(cycling_prompt(n, at), m) for n, at, m in ((40, 3, 80), (9, 11, 20), (23, 17, 80), (61, 5, 80))]
    speculates_like_decoding_alone(speculating, bodies, "ngram")


def test_a_stop_sequence_inside_an_accepted_draft_ends_the_reply_there(speculating):
    prompt = cycling_prompt(40, 3)
    whole = complete(speculating, prompt, 80, speculate=False)["choices"][0]["text"]
    stop = whole[len(whole) * 2 // 3 : len(whole) * 2 // 3 + 3]
    assert stop.strip()
    without = complete(speculating, prompt, 80, speculate=False, stop=[stop])
    withit = complete(speculating, prompt, 80, speculate=True, stop=[stop])
    assert withit["choices"][0]["text"] == without["choices"][0]["text"] == whole[: whole.index(stop)]
    assert withit["choices"][0]["finish_reason"] == "stop"


def test_a_grammar_constrained_reply_beside_a_free_one(speculating):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
              "additionalProperties": False}

    def chat(speculate: bool, constrained: bool) -> str:
        body = {"model": "m", "messages": [{"role": "user", "content": "Hello there " * 5}], "max_tokens": 40,
                "temperature": 0, "speculate": speculate}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        r = HTTP.post(speculating.url + "/v1/chat/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    expected = [chat(False, True), chat(False, False)]
    got: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, chat(True, i == 0))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got[0], got[1]] == expected
    assert got[0].startswith('{"a":')  # the grammar held (40 tokens cut the string short)


def test_a_client_that_leaves_mid_stream_leaves_the_others_served(speculating):
    prompt = cycling_prompt(40, 3)
    with HTTP.stream("POST", speculating.url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # leaves after the first chunk, while its drafts are being verified
    expected = complete(speculating, prompt, 30, speculate=False)["choices"][0]["text"]
    assert complete(speculating, prompt, 30, speculate=True)["choices"][0]["text"] == expected
    assert "Traceback" not in speculating.log()


@pytest.fixture(scope="module")
def drafting_server(start_module_server, llama_with_draft):
    """The tiny llama with its first 3 layers as --draft-model (which turns --speculate draft on)."""
    path, small = llama_with_draft
    return start_module_server("--model", str(path), "--model-id", "m", "--no-kv-disk", "--max-batch", "4",
                               "--draft-model", str(small))


def test_a_draft_model_serves_concurrent_requests_their_own_tokens(drafting_server):
    bodies = [(cycling_prompt(n, at), m) for n, at, m in ((40, 3, 60), (9, 11, 20), (23, 17, 60))]
    speculates_like_decoding_alone(drafting_server, bodies, "draft")
    assert "drafts with llama-3-layers" in drafting_server.log()


@pytest.mark.parametrize("argv, needle", [
    (["--speculate", "draft"], "--speculate draft needs --draft-model"),
    (["--speculate", "ngram", "--draft-model", "x"], "--draft-model drafts under --speculate draft, not --speculate ngram"),
])
def test_speculation_flags_that_do_not_fit_together_are_one_line_errors(argv, needle, capsys):
    from lmsp_mlx import flags

    with pytest.raises(SystemExit) as exit:
        flags.parse(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and needle in err and err.count("\n") == 1


def test_a_draft_model_turns_speculation_on_unless_told_otherwise():
    from lmsp_mlx import flags

    assert flags.parse(["--draft-model", "x"]).engine.speculate == "draft"
    off = flags.parse(["--draft-model", "x", "--speculate", "off"]).engine
    assert (off.speculate, off.draft_model) == ("off", None)  # nothing to load
    assert flags.parse([]).engine.speculate == "ngram"  # the default: prompt lookup


def test_a_draft_model_with_another_tokenizer_is_a_one_line_start_error(llama_with_draft, tmp_path):
    import subprocess
    import sys

    path, _ = llama_with_draft
    other = first_layers(path, tmp_path / "other", 2)
    write_tokenizer(other, words=("speculation",))
    done = subprocess.run([sys.executable, "-m", "lmsp_mlx.serve", "--model", str(path), "--draft-model", str(other),
                           "--store", str(tmp_path / "s.sqlite3"), "--no-kv-disk", "--state-key-file",
                           str(tmp_path / "k")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"--draft-model {other} cannot draft for" in done.stderr and "vocabulary" in done.stderr
