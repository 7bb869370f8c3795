"""The official OpenAI Python SDK against /v1/responses, on the real default model."""

from __future__ import annotations

import openai
import pytest
from tests.helpers import DEFAULT_MODEL_ID

pytestmark = pytest.mark.slow  # the default model


@pytest.fixture(scope="module")
def sdk(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def test_responses_create(sdk):
    r = sdk.responses.create(model=DEFAULT_MODEL_ID, input="What is the capital of France?", temperature=0)
    assert r.status == "completed"
    assert "Paris" in r.output_text
    assert r.usage.input_tokens > 10 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0  # SmolLM2 does not reason


def test_responses_stream_and_final_response(sdk):
    deltas = []
    with sdk.responses.stream(
        model=DEFAULT_MODEL_ID,
        instructions="You answer in one short sentence.",
        input=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_output_tokens=40,
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(deltas)
    assert "Paris" in final.output_text


def test_models_through_the_sdk(sdk):
    assert [m.id for m in sdk.models.list()] == [DEFAULT_MODEL_ID]
    assert sdk.models.retrieve(DEFAULT_MODEL_ID).id == DEFAULT_MODEL_ID
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


def test_incomplete_and_errors_through_the_sdk(sdk):
    r = sdk.responses.create(model=DEFAULT_MODEL_ID, input="Tell me a long story.", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model="no-such-model", input="hi")
    with pytest.raises(openai.BadRequestError):
        sdk.responses.create(model=DEFAULT_MODEL_ID, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])


def test_stored_responses_and_previous_response_id_through_the_sdk(sdk):
    first = sdk.responses.create(model=DEFAULT_MODEL_ID, input="Name a colour.", temperature=0, max_output_tokens=10)
    assert sdk.responses.retrieve(first.id).output_text == first.output_text  # stored by default, as on OpenAI
    second = sdk.responses.create(model=DEFAULT_MODEL_ID, input="And another one?", previous_response_id=first.id,
                                  temperature=0, max_output_tokens=10, store=False)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(second.id)


def test_structured_output_through_the_sdk_parse(sdk):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population_millions: int = Field(ge=0, le=100)  # unbounded, a 135M model can ramble digits

    r = sdk.responses.parse(model=DEFAULT_MODEL_ID, input="Describe Paris.", text_format=City, temperature=0,
                            max_output_tokens=120)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City)
