"""The chat page at `/`, driven in a real headless Chromium (Debian's, through Playwright):
a person picks a model, types a question, sees the answer stream in with its reasoning
folded away and its tool calls shown, stops a reply, finds the conversation again after a
reload, and gives a token where the server has one. JSON clients still get JSON at `/`."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from tests.helpers import HTTP
from tests.test_chat import CHAT_TOOLS
from tests.tiny_model import ENDLESS

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip("no Chromium here (Debian's package `chromium`, which .ci/run installs)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (the test extra has it)")

# As this machine's closed network needs: no background fetches, no sandbox as root.
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(bypass_csp=True)  # Playwright's waits evaluate strings; the page's CSP forbids that
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert not errors, errors  # the page's script never threw


@pytest.fixture(scope="module")
def scripted_page_server(start_module_server, scripted_dir):
    return start_module_server("--model", str(scripted_dir), "--model-id", "scripted")


@pytest.fixture(scope="module")
def caller_page_server(start_module_server, caller_dir):
    return start_module_server("--model", str(caller_dir), "--model-id", "caller")


def models_listed(page) -> None:
    sync_api.expect(page.locator("#model option")).not_to_have_count(0, timeout=10_000)


def ask(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def settings(page, temperature: str = "0", max_tokens: str | None = None) -> None:
    page.click("#settings summary")
    page.fill("#temperature", temperature)
    if max_tokens is not None:
        page.fill("#max-tokens", max_tokens)


def test_a_question_streams_its_answer_with_the_reasoning_folded(page, scripted_page_server):
    page.goto(scripted_page_server.url + "/")
    models_listed(page)
    assert page.input_value("#model") == "scripted"
    settings(page)
    ask(page, "Hello?")
    answer = page.locator(".msg.assistant").last
    sync_api.expect(answer.locator(".stats")).to_contain_text("tok/s", timeout=30_000)
    assert answer.locator(".content").inner_text() == "OK"
    fold = answer.locator("details.reasoning")
    assert fold.get_attribute("open") is None  # folded away
    assert fold.locator(".reasoning-text").text_content() == " the"
    # The second turn continues the conversation: most of its prompt comes from the cache.
    ask(page, "And again?")
    second = page.locator(".msg.assistant").nth(1)
    sync_api.expect(second.locator(".stats")).to_contain_text("from the cache", timeout=30_000)
    cached = int(second.locator(".stats").inner_text().split("tokens, ")[-1].split(" from")[0])
    assert cached > 0
    # Conversations stay in the browser.
    page.reload()
    sync_api.expect(page.locator(".msg.assistant")).to_have_count(2)
    assert page.locator("#conversations li").count() == 1
    assert page.locator("#conversations li").inner_text().startswith("Hello?")


def test_tool_calls_are_shown(page, caller_page_server):
    page.goto(caller_page_server.url + "/")
    models_listed(page)
    settings(page)
    page.fill("#tools", json.dumps(CHAT_TOOLS))
    ask(page, "Weather and time in Paris?")
    answer = page.locator(".msg.assistant").last
    sync_api.expect(answer.locator(".stats")).to_contain_text("tok/s", timeout=30_000)
    calls = answer.locator(".call").all_inner_texts()
    assert calls == ['tool call: get_weather({"city": "Paris"})', 'tool call: get_time({"zone": "CET"})']


def test_a_reply_can_be_stopped_and_the_next_question_is_answered(page, tiny_server):
    page.goto(tiny_server.url + "/")
    models_listed(page)
    settings(page, max_tokens="30000")  # at thousands of tokens a second, long enough to stop
    ask(page, ENDLESS)  # the tiny model's endless reply
    answer = page.locator(".msg.assistant").last
    sync_api.expect(answer.locator(".content")).not_to_be_empty(timeout=30_000)
    page.click("#stop")
    sync_api.expect(answer.locator(".stats")).to_contain_text("stopped after", timeout=10_000)
    assert page.is_visible("#send") and not page.is_visible("#stop")
    page.fill("#max-tokens", "4")
    ask(page, "Hello there")
    sync_api.expect(page.locator(".msg.assistant").nth(1).locator(".stats")).to_contain_text("tok/s", timeout=30_000)


def test_a_reload_while_a_reply_streams_keeps_what_came(page, tiny_server):
    page.goto(tiny_server.url + "/")
    models_listed(page)
    settings(page, max_tokens="30000")
    ask(page, ENDLESS)
    # The reply so far is saved once a second while it streams.
    page.wait_for_function("JSON.parse(localStorage.getItem('lmsp-mlx.conversations'))[0].messages[1].content",
                           timeout=30_000)
    page.reload()
    answer = page.locator(".msg.assistant").last
    sync_api.expect(answer.locator(".stats")).to_have_text("interrupted")
    assert answer.locator(".content").inner_text()


def test_settings_stay_and_a_refused_question_shows_why(page, tiny_server):
    page.goto(tiny_server.url + "/")
    models_listed(page)
    settings(page, temperature="5", max_tokens="7")
    page.dispatch_event("#temperature", "change")
    page.dispatch_event("#max-tokens", "change")
    ask(page, "Hello there")
    sync_api.expect(page.locator(".msg.error")).to_contain_text("temperature", timeout=10_000)
    assert page.locator(".msg.assistant").count() == 0  # no empty reply left above the error
    page.reload()
    models_listed(page)
    assert page.input_value("#temperature") == "5" and page.input_value("#max-tokens") == "7"


def test_a_server_with_tokens_asks_for_one(page, start_server, tiny_model_dir):
    server = start_server("--model", str(tiny_model_dir), "--model-id", "tiny", "--api-key", "sesame")
    page.goto(server.url + "/")
    sync_api.expect(page.locator("#status")).to_contain_text("needs an API token", timeout=10_000)
    page.fill("#token", "sesame")
    page.dispatch_event("#token", "change")
    models_listed(page)
    settings(page, max_tokens="4")
    ask(page, "Hello there")
    sync_api.expect(page.locator(".msg.assistant").last.locator(".stats")).to_contain_text("tok/s", timeout=30_000)


def test_json_clients_and_head_still_get_the_liveness_answer(tiny_server):
    for accept in ("application/json", "*/*", None):
        r = HTTP.get(tiny_server.url + "/", headers={"Accept": accept} if accept else {})
        assert r.status_code == 200 and r.json()["service"] == "lmsp-mlx", accept
    assert HTTP.head(tiny_server.url + "/").headers["content-type"].startswith("application/json")
    html = HTTP.get(tiny_server.url + "/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert html.headers["content-type"].startswith("text/html") and "chat.js" in html.text
    assert HTTP.get(tiny_server.url + "/ui/other.js").status_code == 404
