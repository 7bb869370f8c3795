"""POST /v1/completions: OpenAI's legacy text completions, the body and the objects answered.

The prompt is text (or token ids) the model continues as it is: no chat template, and the
reply is plain text (think tags and call markup included). Benchmarks (`vllm bench serve`,
llmperf), evaluation harnesses and editor autocompletion speak this API.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .chat import STOPS_DETAIL, Stops, StreamOptions, stop_list
from .ids import new_id
from .problems import Problem
from .requests import LogitBias, Penalty, Seed, Temperature, TopP, json_object, validation_problem

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
MAX_PROMPTS = 64  # prompts of one request (each a sequence in the batch, or waiting for one)


class _Completions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class CompletionRequest(_Completions):
    model: str
    # One prompt (text, or token ids), or OpenAI's batch forms: a list of them, one choice each
    # (lm-eval-harness batches its loglikelihood requests so).
    prompt: Union[str, TokenIds, Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]]
    # OpenAI's default; 0 with echo scores the prompt alone (lm-eval-harness's loglikelihood).
    max_tokens: Annotated[int, Field(ge=0)] = 16
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stops | None = None
    echo: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    logit_bias: LogitBias | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # each token's logprob and this many alternatives
    suffix: str | None = None  # refused unless empty: no fill-in-the-middle here
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension, which `vllm bench serve` sends for fixed output lengths
    speculate: bool | None = None  # an extension: false drafts no tokens for this request (--speculate)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, in the order of the choices."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]

    def stops(self) -> list[str]:
        return stop_list(self.stop)


def parse_completion(body: Any) -> CompletionRequest:
    """Validate a decoded body; every failure is a 400 naming the field."""
    try:
        req = CompletionRequest.model_validate(json_object(body))
    except ValidationError as exc:
        problem = validation_problem(exc, frozenset())
        if (problem.param or "").startswith("prompt"):
            problem.detail = (f"prompt must be a string, a list of token ids, or a list of up to {MAX_PROMPTS} "
                              "of either")
            problem.param = "prompt"
        elif problem.param in ("n", "best_of"):
            problem.detail = f"{problem.param} must be 1: this server returns one choice per request"
        elif (problem.param or "").startswith("stop"):
            problem.detail = STOPS_DETAIL
            problem.param = "stop"
        raise problem from None
    if req.suffix:
        raise Problem("unsupported_capability", "suffix (fill in the middle) is not supported", param="suffix")
    return req


def completion_id() -> str:
    return new_id("cmpl")


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def text_choice(index: int, text: str, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a `text_completion`; `logprobs`: its (`protocol/logprobs.completion_logprobs`)."""
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}


def text_completion(cid: str, created: int, model: str, choices: list[dict[str, Any]],
                    use: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `text_completion` object, or a streamed chunk of one (no choices: the usage chunk)."""
    out: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model,
                           "system_fingerprint": None, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
