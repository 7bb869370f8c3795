// The chat page: talks to this server's /v1/chat/completions as any OpenAI client does,
// streams the reply, folds its reasoning away, shows tool calls, and keeps the
// conversations in this browser's localStorage. No build step, nothing fetched from
// elsewhere: the server serves these three files.
"use strict";

const KEY = { conversations: "lmsp-mlx.conversations", current: "lmsp-mlx.current", token: "lmsp-mlx.token",
              model: "lmsp-mlx.model", settings: "lmsp-mlx.settings" };
const SETTINGS = ["system", "temperature", "max-tokens", "tools"];  // kept in the browser with the conversations
const $ = (id) => document.getElementById(id);
let conversations = JSON.parse(localStorage.getItem(KEY.conversations) || "[]");
let current = localStorage.getItem(KEY.current);
let running = null;  // the AbortController of the reply being streamed

function save() {
  localStorage.setItem(KEY.conversations, JSON.stringify(conversations));
  if (current) localStorage.setItem(KEY.current, current);
}

function conversation() {
  let c = conversations.find((c) => c.id === current);
  if (!c) {
    c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "New chat", messages: [] };
    conversations.unshift(c);
    current = c.id;
  }
  return c;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const token = $("token").value.trim();
  if (token) h.Authorization = "Bearer " + token;
  return h;
}

function status(text) { $("status").textContent = text || ""; }

async function problem(res) {
  try {
    const body = await res.json();
    return (body.error && body.error.message) || body.detail || body.title || res.statusText;
  } catch (e) {
    return res.status + " " + res.statusText;
  }
}

async function loadModels() {
  const res = await fetch("/v1/models", { headers: headers() });
  if (!res.ok) {
    status(res.status === 401 ? "This server needs an API token: enter it on the left." : await problem(res));
    return;
  }
  status("");
  const models = (await res.json()).data.filter((m) => !m.capabilities || m.capabilities.includes("text"));
  const select = $("model");
  const chosen = select.value || localStorage.getItem(KEY.model);
  select.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
  if (models.some((m) => m.id === chosen)) select.value = chosen;
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren(...conversations.map((c) => {
    const li = document.createElement("li");
    li.className = c.id === current ? "current" : "";
    const title = document.createElement("span");
    title.textContent = c.title;
    const drop = document.createElement("button");
    drop.type = "button";
    drop.title = "Delete";
    drop.textContent = "×";
    drop.onclick = (e) => {
      e.stopPropagation();
      conversations = conversations.filter((x) => x.id !== c.id);
      if (current === c.id) current = conversations.length ? conversations[0].id : null;
      save();
      render();
    };
    li.onclick = () => { if (!running) { current = c.id; save(); render(); } };
    li.append(title, drop);
    return li;
  }));
}

function messageView(m) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  if (m.reasoning) {
    const fold = document.createElement("details");
    fold.className = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const body = document.createElement("div");
    body.className = "reasoning-text";
    body.textContent = m.reasoning;
    fold.append(summary, body);
    div.append(fold);
  }
  const text = document.createElement("div");
  text.className = "content";
  text.textContent = m.content || "";
  div.append(text);
  for (const call of m.tool_calls || []) {
    const c = document.createElement("div");
    c.className = "call";
    c.textContent = "tool call: " + call.function.name + "(" + call.function.arguments + ")";
    div.append(c);
  }
  if (m.stats) {
    const s = document.createElement("div");
    s.className = "stats";
    s.textContent = m.stats;
    div.append(s);
  }
  return div;
}

function render() {
  renderList();
  const c = conversations.find((c) => c.id === current);
  $("messages").replaceChildren(...(c ? c.messages.map(messageView) : []));
  $("messages").scrollTop = $("messages").scrollHeight;
}

// The conversation as Chat messages; the reply being streamed (still empty) is left out.
function history(c) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of c.messages) {
    if (m.role === "error") continue;
    if (m.role === "assistant") {
      if (!m.content && !(m.tool_calls || []).length) continue;  // a reply stopped before its first word
      // Calls the page cannot run are shown, not replayed: their outputs never existed.
      const said = m.content || (m.tool_calls || []).map((t) => "[called " + t.function.name + "]").join(" ");
      const a = { role: "assistant", content: said };
      if (m.reasoning) a.reasoning_content = m.reasoning;
      out.push(a);
    } else {
      out.push({ role: m.role, content: m.content });
    }
  }
  return out;
}

function statsLine(usage, began, first, ended) {
  if (!usage) return "";
  // From the first token on; a reply that arrived in one piece is timed from the question.
  const decode = first && ended - first > 50 && usage.completion_tokens > 1
    ? (usage.completion_tokens - 1) / ((ended - first) / 1000) : usage.completion_tokens / ((ended - began) / 1000);
  const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
  return decode.toFixed(1) + " tok/s · " + usage.completion_tokens + " tokens · first token " +
    (((first || ended) - began) / 1000).toFixed(2) + " s · prompt " + usage.prompt_tokens + " tokens, " +
    cached + " from the cache";
}

async function send(text) {
  const c = conversation();
  if (!c.messages.length) c.title = text.slice(0, 40);
  c.messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
  c.messages.push(reply);
  save();
  render();
  let view = $("messages").lastElementChild;
  // Redrawn at most every 50 ms while it streams, from the read loop itself: a fast stream's
  // reads resolve one after another without a frame between them.
  let drawn = 0, saved = performance.now();
  reply.stats = "interrupted";  // what a reload finds, until the reply ends
  const draw = () => {
    drawn = performance.now();
    const fresh = messageView({ ...reply, stats: "" });
    view.replaceWith(fresh);
    view = fresh;
    fresh.scrollIntoView({ block: "end" });
    if (performance.now() - saved > 1000) { saved = performance.now(); save(); }  // a reload keeps the reply so far
  };
  const body = { model: $("model").value, messages: history(c), stream: true,
                 stream_options: { include_usage: true }, max_tokens: Number($("max-tokens").value) || undefined,
                 temperature: Number($("temperature").value) };
  const tools = $("tools").value.trim();
  if (tools) {
    try { body.tools = JSON.parse(tools); } catch (e) { status("Tools are not valid JSON: " + e.message); }
  }
  running = new AbortController();
  $("send").hidden = true;
  $("stop").hidden = false;
  const began = performance.now();
  let first = null, usage = null, stopped = false;
  try {
    const res = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                      signal: running.signal });
    if (!res.ok) throw new Error(await problem(res));
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of frame.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const chunk = JSON.parse(line.slice(6));
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (!delta) continue;
          if (delta.content || delta.reasoning_content) first = first || performance.now();
          reply.content += delta.content || "";
          reply.reasoning += delta.reasoning_content || "";
          for (const call of delta.tool_calls || []) reply.tool_calls.push(call);
        }
      }
      if (performance.now() - drawn > 50) draw();
    }
  } catch (e) {
    if (e.name === "AbortError") {
      stopped = true;
    } else {
      if (!reply.content && !reply.reasoning && !reply.tool_calls.length) c.messages.pop();  // nothing came
      c.messages.push({ role: "error", content: e.message });
    }
  } finally {
    running = null;
    $("send").hidden = false;
    $("stop").hidden = true;
  }
  const ended = performance.now();
  reply.stats = stopped ? "stopped after " + ((ended - began) / 1000).toFixed(1) + " s"
    : statsLine(usage, began, first, ended);
  save();
  render();
}

$("ask").onsubmit = (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || running) return;
  $("input").value = "";
  send(text);
};
$("input").onkeydown = (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask").requestSubmit(); }
};
$("stop").onclick = () => { if (running) running.abort(); };
$("new-chat").onclick = () => { if (!running) { current = null; conversation(); save(); render(); } };
const settings = JSON.parse(localStorage.getItem(KEY.settings) || "{}");
for (const id of SETTINGS) {
  if (settings[id] !== undefined) $(id).value = settings[id];
  $(id).onchange = () => {
    settings[id] = $(id).value;
    localStorage.setItem(KEY.settings, JSON.stringify(settings));
  };
}
$("token").value = localStorage.getItem(KEY.token) || "";
$("token").onchange = () => { localStorage.setItem(KEY.token, $("token").value.trim()); loadModels(); };
$("model").onchange = () => localStorage.setItem(KEY.model, $("model").value);
render();
loadModels();
