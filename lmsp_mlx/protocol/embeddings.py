"""POST /v1/embeddings: OpenAI's embeddings API, the body and the object answered.

Inputs are a string, a list of strings, token ids, or a list of token-id lists; each
gives one vector, in order. `encoding_format` "base64" packs each vector as little-endian
float32 bytes (what the OpenAI SDK asks for by default and unpacks); `dimensions` keeps a
vector's first n values, normalised again where the model's vectors are normalised."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .problems import Problem
from .requests import json_object, validation_problem

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    input: Union[str, Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)], TokenIds,
                 Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None

    @property
    def listed(self) -> bool:
        """The input is a list of inputs (each then named `input[n]`), not one input."""
        i = self.input
        return not (isinstance(i, str) or i and isinstance(i[0], int))

    def inputs(self) -> list[str | list[int]]:
        """One entry per vector: a text or token ids."""
        return list(self.input) if self.listed else [self.input]


def parse_embedding(body: Any) -> EmbeddingRequest:
    """Validate a decoded body; every failure is a 400 naming the field."""
    try:
        req = EmbeddingRequest.model_validate(json_object(body))
    except ValidationError as exc:
        problem = validation_problem(exc, frozenset())
        if (problem.param or "").startswith("input"):
            problem.detail = ("input must be a non-empty string, a list of up to 2048 strings, a list of token ids, "
                              "or a list of up to 2048 such lists")
            problem.param = "input"
        raise problem from None
    for n, one in enumerate(req.inputs()):
        if isinstance(one, str) and not one:
            raise Problem("invalid_request", "an input is empty: each must hold some text",
                          param=f"input[{n}]" if req.listed else "input")
    return req


def embedding_list(model: str, vectors: list[list[float]], encoding: Literal["float", "base64"],
                   tokens: int) -> dict[str, Any]:
    """OpenAI's list of `embedding` objects, with usage."""
    def packed(v: list[float]) -> list[float] | str:
        return v if encoding == "float" else base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": packed(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
