// The chat page's behaviour (chat.html): conversations kept in localStorage, answers streamed from
// /v1/chat/completions and rendered as markdown (markdown.js, safely), each with its speed (time to the first
// token, tokens per second), Stop, and Regenerate for the last answer.
"use strict";
const $ = (id) => document.getElementById(id);
const STORE = "llama-chat-v1";
let state = JSON.parse(localStorage.getItem(STORE) || "null") || {convs: [], current: null, settings: {}};
let model = null, controller = null;

function save() { localStorage.setItem(STORE, JSON.stringify(state)); }
function current() { return state.convs.find((c) => c.id === state.current); }

function newConversation() {
  const c = {id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New conversation",
             system: $("system").value, messages: []};
  state.convs.unshift(c);
  state.current = c.id;
  save();
  render();
}

// A message's body: the user's text as typed, the assistant's as markdown.
function fill(d, role, text) {
  d.textContent = "";
  if (role === "assistant") d.appendChild(renderMarkdown(text)); else d.textContent = text;
}

// "12 tokens · 35.1 tok/s · first token 180 ms" under an answer. tokens: the server's usage count; tok/s: the
// tokens after the first over the time after the first (decode speed); first token: from sending the request.
function statsText(s) {
  const rate = s.tokens > 1 && s.decode_ms > 0 ? ((s.tokens - 1) / (s.decode_ms / 1000)).toFixed(1) : "–";
  return `${s.tokens} tokens · ${rate} tok/s · first token ${Math.round(s.ttft_ms)} ms`;
}

function showStats(d, s) {
  let line = d.querySelector(".stats");
  if (!line) {
    line = document.createElement("div");
    line.className = "stats";
    line.title = "tok/s: the tokens after the first over the time after the first; first token: from sending the " +
                 "request (the server's usage count of tokens)";
    d.appendChild(line);
  }
  line.textContent = statsText(s);
}

function bubble(role, text, stats) {
  const d = document.createElement("div");
  d.className = "msg " + role;
  fill(d, role, text);
  if (stats) showStats(d, stats);
  $("log").appendChild(d);
  $("log").scrollTop = $("log").scrollHeight;
  return d;
}

function updateButtons() {
  const c = current(), busy = controller !== null;
  const last = c && c.messages.length ? c.messages[c.messages.length - 1] : null;
  $("stop").disabled = !busy;
  $("send").disabled = busy;
  $("regen").disabled = busy || !last || last.role !== "assistant";
}

function render() {
  const list = $("convs");
  list.textContent = "";
  for (const c of state.convs) {
    const d = document.createElement("div");
    d.textContent = c.title;
    d.className = c.id === state.current ? "active" : "";
    d.onclick = () => { if (!controller) { state.current = c.id; save(); render(); } };
    list.appendChild(d);
  }
  $("log").textContent = "";
  const c = current();
  if (!c) return;
  $("system").value = c.system || "";
  for (const m of c.messages) bubble(m.role, m.content, m.stats);
  updateButtons();
}

for (const id of ["temperature", "max_tokens", "apikey"]) {
  if (state.settings[id] !== undefined) $(id).value = state.settings[id];
  $(id).addEventListener("change", () => { state.settings[id] = $(id).value; save(); });
}
$("system").addEventListener("change", () => { const c = current(); if (c) { c.system = $("system").value; save(); } });

async function send(text) {
  let c = current();
  if (!c) { newConversation(); c = current(); }
  c.system = $("system").value;
  c.messages.push({role: "user", content: text});
  if (c.title === "New conversation") c.title = text.slice(0, 40);
  save();
  render();
  await answer(c);
}

// The last answer again: dropped, and the dialog up to the user's last message asked anew.
async function regenerate() {
  const c = current();
  if (!c || controller || !c.messages.length || c.messages[c.messages.length - 1].role !== "assistant") return;
  c.messages.pop();
  save();
  render();
  await answer(c);
}

async function answer(c) {
  const dialog = (c.system ? [{role: "system", content: c.system}] : []).concat(c.messages);
  const out = bubble("assistant", "");
  const reply = {role: "assistant", content: ""};
  controller = new AbortController();
  updateButtons();
  $("status").textContent = "generating…";
  const sent = performance.now();
  let first = null, tokens = null;
  const headers = {"Content-Type": "application/json"};
  if ($("apikey").value) headers["Authorization"] = "Bearer " + $("apikey").value;
  let finish = null;
  try {
    const resp = await fetch("/v1/chat/completions", {method: "POST", headers, signal: controller.signal,
      body: JSON.stringify({model, messages: dialog, stream: true, stream_options: {include_usage: true},
                            temperature: Number($("temperature").value),
                            max_tokens: Number($("max_tokens").value) || undefined})});
    if (!resp.ok) {
      let msg = resp.status + " " + resp.statusText;
      try { msg = (await resp.json()).error.message; } catch (e) {}
      throw new Error(msg);
    }
    const reader = resp.body.getReader(), decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, cut); buf = buf.slice(cut + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error(obj.error.message);
        if (obj.usage) tokens = obj.usage.completion_tokens;
        for (const ch of obj.choices || []) {
          if (ch.delta && ch.delta.content) {
            if (first === null) first = performance.now();
            reply.content += ch.delta.content;
            fill(out, "assistant", reply.content);
          }
          if (ch.finish_reason) finish = ch.finish_reason;
        }
        $("log").scrollTop = $("log").scrollHeight;
      }
    }
    $("status").textContent = finish === "length" ? "stopped at max tokens" : "";
  } catch (e) {
    if (e.name === "AbortError") { $("status").textContent = "stopped"; }
    else { bubble("error", String(e.message || e)); $("status").textContent = ""; }
  } finally {
    if (first !== null && tokens !== null) {
      reply.stats = {tokens, ttft_ms: first - sent, decode_ms: performance.now() - first};
      showStats(out, reply.stats);
    }
    if (reply.content) c.messages.push(reply); else out.remove();
    save();
    controller = null;
    updateButtons();
  }
}

$("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
});
$("stop").onclick = () => { if (controller) controller.abort(); };
$("regen").onclick = () => { regenerate(); };
$("new").onclick = () => { if (!controller) newConversation(); };

fetch("/config").then((r) => r.json()).then((cfg) => {
  model = cfg.model;
  document.title = cfg.model + " · llama chat";
  $("keylabel").style.display = cfg.api_key_required ? "" : "none";
}).catch(() => {});
render();
