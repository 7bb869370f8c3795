"""POST /lmsp/v1/responses, synchronous (section 6.2), and discovery routes."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import HTTP, ask
from tests.tiny_model import FINISHES


def test_service_document_lists_the_model(client):
    r = client.get("/lmsp/v1")
    assert r.status_code == 200
    assert r.headers["LMSP-Version"] == "1.0"
    doc = r.json()
    assert doc["lmsp_version"] == "1.0"
    assert doc["models"][0] == "tiny"  # the default first; the model store's follow
    assert "text" in doc["capabilities"]


def test_the_root_names_where_the_apis_are(client):
    # Clients probe / before their first call (Claude Code sends HEAD /): it answers like /healthz.
    doc = client.get("/").json()
    assert doc == {"service": "lmsp-mlx", "lmsp": "/lmsp/v1", "openai": "/v1", "anthropic": "/v1/messages"}
    assert client.head("/").status_code == 200
    assert client.get("/lmsp/v1/").json() == client.get("/lmsp/v1").json()


def test_models_listing_reports_context_and_backend(client):
    models = client.get("/lmsp/v1/models").json()["data"]
    model = models[0]  # the default; the model store's models follow, not loaded
    assert model["id"] == "tiny" and model["loaded"] is True and all(m["loaded"] is False for m in models[1:])
    assert model["context_length"] == 32768
    assert model["capabilities"] == ["text", "tools", "structured_output", "conversations", "embeddings"]  # no <think> tags: no "reasoning"
    assert model["backend"] in ("cpu", "metal", "cuda")
    assert model["quantization"]
    if model["backend"] == "cpu" and sys.platform.startswith("linux"):
        assert model["cpu_matmul"].startswith("OpenBLAS")  # the server process routes MLX's matmuls
    assert client.get("/lmsp/v1/models/tiny").json()["id"] == "tiny"
    missing = client.get("/lmsp/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["code"] == "model_not_found"


def test_sync_response_has_the_section_6_2_shape(client):
    r = client.post("/lmsp/v1/responses", json=ask(FINISHES, max_output_tokens=100))
    assert r.status_code == 200
    assert r.headers["LMSP-Version"] == "1.0"
    body = r.json()
    assert set(body) == {
        "id", "object", "created_at", "status", "model", "output", "usage", "error", "incomplete_details",
    }
    assert re.fullmatch(r"resp_[0-9A-Z]{26}", body["id"])
    assert body["object"] == "response"
    assert body["model"] == "tiny"
    assert body["error"] is None
    [item] = body["output"]
    assert re.fullmatch(r"msg_[0-9A-Z]{26}", item["id"])
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"][0]["type"] == "output_text"
    assert item["content"][0]["text"]
    assert body["status"] == "completed"
    assert body["incomplete_details"] is None


def test_max_output_tokens_makes_the_response_incomplete(client):
    body = client.post("/lmsp/v1/responses", json=ask(max_output_tokens=5)).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 5


def test_usage_counts_the_real_prompt_tokens(client, tiny_model_dir):
    from tokenizers import Tokenizer

    text = "Count these tokens, the whole prompt"
    body = client.post("/lmsp/v1/responses", json=ask(text, max_output_tokens=3)).json()
    prompt = "<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n"
    expected = len(Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(prompt).ids)
    usage = body["usage"]
    assert usage["input_tokens"] == expected
    assert usage["output_tokens"] == 3
    assert usage["total_tokens"] == expected + 3


def test_temperature_zero_is_deterministic(client):
    first = client.post("/lmsp/v1/responses", json=ask(max_output_tokens=20)).json()
    second = client.post("/lmsp/v1/responses", json=ask(max_output_tokens=20)).json()
    assert first["output"][0]["content"] == second["output"][0]["content"]
    assert first["id"] != second["id"]


def test_string_input_equals_one_user_message(client):
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}]
    as_items = client.post("/lmsp/v1/responses", json=ask(input=items)).json()
    as_string = client.post("/lmsp/v1/responses", json=ask("Hello there")).json()
    assert as_items["usage"] == as_string["usage"]
    assert as_items["output"][0]["content"] == as_string["output"][0]["content"]


def test_roles_and_multi_turn_input_are_rendered(client):
    items = [
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be terse."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again"}]},
    ]
    body = client.post("/lmsp/v1/responses", json=ask(input=items)).json()
    short = client.post("/lmsp/v1/responses", json=ask("Again")).json()
    assert body["usage"]["input_tokens"] > short["usage"]["input_tokens"] + 10


def test_sampling_with_temperature_and_top_p(client):
    body = client.post(
        "/lmsp/v1/responses", json=ask(temperature=1.2, top_p=0.9, store=True, extensions={"x-test": 1},
                                       response_format={"type": "text"})
    ).json()
    assert body["status"] in ("completed", "incomplete")
    assert body["usage"]["output_tokens"] >= 1
    # top_p 0 keeps only the likeliest token: the greedy reply at any temperature.
    greedy = client.post("/lmsp/v1/responses", json=ask(max_output_tokens=16)).json()
    for _ in range(2):
        hot = client.post("/lmsp/v1/responses", json=ask(temperature=2, top_p=0, max_output_tokens=16)).json()
        assert hot["output"][0]["content"] == greedy["output"][0]["content"]


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_server):
    r = HTTP.post(
        default_server.url + "/lmsp/v1/responses",
        json={
            "model": "SmolLM2-135M-Instruct",
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
            "temperature": 0,
            "max_output_tokens": 30,
        },
        timeout=300,
    )
    assert r.status_code == 200
    body = r.json()
    assert "Paris" in body["output"][0]["content"][0]["text"]
    assert body["status"] == "completed"
    model = HTTP.get(default_server.url + "/lmsp/v1/models").json()["data"][0]
    assert model["id"] == "SmolLM2-135M-Instruct"
    assert model["context_length"] == 8192


def test_the_openapi_document_lists_every_route(client, tiny_server):
    doc = client.get("/lmsp/v1/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path, method in [("/lmsp/v1/responses", "post"), ("/lmsp/v1/responses/{response_id}", "get"),
                         ("/lmsp/v1/tasks", "post"), ("/lmsp/v1/tasks/{task_id}", "get"),
                         ("/lmsp/v1/tasks/{task_id}/events", "get"), ("/lmsp/v1/tasks/{task_id}/cancel", "post"),
                         ("/lmsp/v1/models", "get"), ("/lmsp/v1/openapi.json", "get"), ("/v1/responses", "post"),
                         ("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/v1/models", "get"),
                         ("/v1/messages", "post"), ("/v1/messages/count_tokens", "post"),
                         ("/healthz", "get"), ("/metrics", "get")]:
        assert method in doc["paths"][path], path
    create = doc["paths"]["/lmsp/v1/responses"]["post"]
    assert create["security"] == [{"bearer": ["responses:write"]}]
    assert create["requestBody"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/ResponsesRequest"
    # Each route's answers as it gives them: a task is created with 202, its events are a
    # stream resumed with `after` or Last-Event-ID, a stored response is JSON only.
    paths = doc["paths"]
    assert set(paths["/lmsp/v1/tasks"]["post"]["responses"]) == {"202", "default"}
    assert "Location" in paths["/lmsp/v1/tasks"]["post"]["responses"]["202"]["headers"]
    events = paths["/lmsp/v1/tasks/{task_id}/events"]["get"]
    assert {(p["name"], p["in"]) for p in events["parameters"]} >= {("after", "query"), ("Last-Event-ID", "header")}
    assert set(events["responses"]["200"]["content"]) == {"text/event-stream"}
    assert set(paths["/lmsp/v1/responses/{response_id}"]["get"]["responses"]["200"]["content"]) == {"application/json"}
    assert "text/event-stream" in create["responses"]["200"]["content"]
    resume = paths["/v1/responses/{response_id}"]["get"]  # a background response streamed again
    assert {p["name"] for p in resume["parameters"]} == {"response_id", "stream", "starting_after"}
    assert set(resume["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    messages = paths["/v1/messages"]["post"]  # Anthropic's body, and its error shape
    assert messages["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/MessagesRequest")
    assert messages["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicError")
    schemas = doc["components"]["schemas"]
    assert {"ResponsesRequest", "ResponseObject", "Problem", "TaskCreate", "Task", "ChatRequest",
            "CompletionRequest", "MessagesRequest", "CountTokensRequest", "AnthropicError"} <= set(schemas)
    # Every reference resolves inside the document.
    import json
    import re

    for ref in set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc))):
        assert ref in schemas, ref
