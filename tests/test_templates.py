"""Chat-template settings: --chat-template FILE, --chat-template-args JSON, a request's
chat_template_kwargs (Chat and Responses), and reasoning effort none turning a template's
thinking off (enable_thinking, as Qwen3's template reads it).

The test template adds a known number of special tokens to the generation prompt for each
setting it reads, so a request's counted input tokens show which settings it got."""

from __future__ import annotations

import pytest
from tests.tiny_model import build_scripted_model
from tests.helpers import HTTP

# enable_thinking false: two more tokens; `extra`: three more.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<|endoftext|><|endoftext|>{% endif %}"
    "{% if extra %}<|im_end|><|im_end|><|im_end|>{% endif %}{% endif %}"
)
# A replacement template: one token more than TEMPLATE's plainest prompt.
OTHER = TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|><|im_start|>assistant\n")
ASK = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def templated_dir(tmp_path_factory):
    return build_scripted_model(tmp_path_factory.mktemp("templated"), template=TEMPLATE)


@pytest.fixture(scope="module")
def server(start_module_server, templated_dir):
    return start_module_server("--model", str(templated_dir), "--no-kv-disk")


def counted(server, **fields) -> int:
    r = HTTP.post(server.url + "/v1/responses/input_tokens", json={"model": server.model, "input": ASK, **fields})
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def chat_prompt_tokens(server, **fields) -> int:
    r = HTTP.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": server.model, "messages": ASK, "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


@pytest.fixture(scope="module", autouse=True)
def model_id(server, templated_dir):
    server.model = templated_dir.name


def test_request_kwargs_and_reasoning_effort_reach_the_template(server):
    plain = counted(server)
    assert counted(server, chat_template_kwargs={"extra": True}) == plain + 3
    assert counted(server, reasoning={"effort": "none"}) == plain + 2
    assert counted(server, reasoning={"effort": "minimal"}) == plain + 2
    assert counted(server, reasoning={"effort": "high"}) == plain
    # The request's own setting wins over what its effort implies.
    assert counted(server, reasoning={"effort": "none"}, chat_template_kwargs={"enable_thinking": True}) == plain


def test_chat_takes_chat_template_kwargs_and_reasoning_effort(server):
    plain = chat_prompt_tokens(server)
    assert chat_prompt_tokens(server, chat_template_kwargs={"extra": True}) == plain + 3
    assert chat_prompt_tokens(server, reasoning_effort="none") == plain + 2


def test_the_listing_says_the_model_reasons(server):
    model = HTTP.get(f"{server.url}/lmsp/v1/models/{server.model}").json()
    assert model["reasoning"] is True and "reasoning" in model["capabilities"]


def test_an_unloaded_model_is_listed_as_reasoning_as_it_will_load(templated_dir, tiny_model_dir):
    from lmsp_mlx.engine.catalog import reasons

    assert reasons(templated_dir) is True  # its vocabulary has <think> and </think>, as mlx-lm looks for them
    assert reasons(tiny_model_dir) is False


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": ["extra"]}),
    ("/v1/responses", {"input": ASK, "chat_template_kwargs": "extra"}),
    # what the rendering sets itself is no setting: it would change what is rendered
    ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {"messages": []}}),
    ("/v1/responses", {"input": ASK, "chat_template_kwargs": {"add_generation_prompt": False}}),
])
def test_kwargs_that_are_not_an_object_are_a_400_naming_them(server, route, body):
    r = HTTP.post(server.url + route, json={"model": server.model, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_server_args_apply_to_every_request_and_a_request_overrides_them(start_server, templated_dir, tmp_path):
    plain = start_server("--model", str(templated_dir), "--no-kv-disk")
    plain.model = templated_dir.name
    base = counted(plain)
    server = start_server("--model", str(templated_dir), "--no-kv-disk",
                          "--chat-template-args", '{"extra": true, "enable_thinking": false}')
    server.model = templated_dir.name
    assert counted(server) == base + 5
    assert counted(server, chat_template_kwargs={"extra": False}) == base + 2
    (tmp_path / "other.jinja").write_text(OTHER)
    other = start_server("--model", str(templated_dir), "--no-kv-disk", "--chat-template", str(tmp_path / "other.jinja"))
    other.model = templated_dir.name
    assert counted(other) == base + 1


@pytest.mark.parametrize("argv, needle", [
    (["--chat-template-args", '{"tools": 5}'], "tools is set by the server's rendering itself"),
    (["--chat-template-args", "{bad"], "not JSON"),
    (["--chat-template", "/nowhere/template.jinja"], "cannot read /nowhere/template.jinja"),
])
def test_bad_template_flags_are_one_line(argv, needle, capsys):
    from lmsp_mlx import flags

    with pytest.raises(SystemExit) as exit:
        flags.parse(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and needle in err and err.count("\n") == 1, err  # no usage dump before it


def test_a_template_that_cannot_render_stops_the_start(templated_dir, tmp_path):
    from lmsp_mlx import flags, serve

    (tmp_path / "broken.jinja").write_text("{% for message in messages %}{{ message['content'] }")
    args = flags.parse(["--model", str(templated_dir), "--chat-template", str(tmp_path / "broken.jinja"),
                             "--no-kv-disk", "--store", str(tmp_path / "s.sqlite3"),
                             "--state-key-file", str(tmp_path / "key")])
    with pytest.raises(serve.StartError, match="chat template of .* cannot render a conversation: TemplateSyntaxError"):
        serve.build(args)
