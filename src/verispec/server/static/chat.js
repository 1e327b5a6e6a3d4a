// The chat page: streams /v1/chat/completions (SSE over fetch) and colours each piece of the reply by the
// "verispec" field of the chunks (app.py): accepted draft tokens or the target's own tokens. "JSON" asks for
// response_format json_object; "log-probabilities" asks for logprobs with 5 alternatives and shows each token of the
// reply under it, shaded by its probability: hovering (or clicking) one shows its log-probability and alternatives.
"use strict";

const KEY_STORE = "verispec.apiKey";
const $ = (id) => document.getElementById(id);
const ui = {
  key: $("key"), temperature: $("temperature"), maxTokens: $("max-tokens"), system: $("system"),
  scroller: $("scroller"), messages: $("messages"), stats: $("stats"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  clear: $("clear"), jsonMode: $("json-mode"), logprobs: $("logprobs"), tokenInfo: $("token-info"),
};
let history = [];  // {role, content} of the finished turns
let controller = null;  // the AbortController of the request in flight

ui.key.value = localStorage.getItem(KEY_STORE) || "";
ui.key.addEventListener("input", () => localStorage.setItem(KEY_STORE, ui.key.value.trim()));
ui.send.addEventListener("click", send);
ui.stop.addEventListener("click", () => controller && controller.abort());
ui.clear.addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  ui.messages.replaceChildren();
  ui.stats.replaceChildren();
});
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});

// Run update(), then scroll to the end if the view was at the end before (a reader scrolled up stays put).
function following(update) {
  const s = ui.scroller;
  const atEnd = s.scrollHeight - s.scrollTop - s.clientHeight < 40;
  update();
  if (atEnd) s.scrollTop = s.scrollHeight;
}

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = `msg ${role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  const note = document.createElement("div");
  note.className = "note";
  box.append(who, body, note);
  ui.messages.append(box);
  ui.scroller.scrollTop = ui.scroller.scrollHeight;
  return {box, body, note};
}

// Append text of one origin, extending the last span when it has the same origin.
function appendPiece(body, text, draft) {
  const cls = draft ? "draft" : "target";
  let span = body.lastElementChild;
  if (!span || span.className !== cls) {
    span = document.createElement("span");
    span.className = cls;
    body.append(span);
  }
  span.textContent += text;
}

// One token of the reply with its log-probability (OpenAI's chat shape): a chip whose shade is its probability.
function addToken(strip, entry) {
  const chip = document.createElement("span");
  chip.className = "lp";
  chip.textContent = entry.token.replace(/\n/g, "\\n").replace(/\t/g, "\\t") || "\u2205";  // whitespace shown
  chip.dataset.token = entry.token;
  chip.dataset.logprob = String(entry.logprob);
  const p = Math.exp(entry.logprob);
  chip.style.background = `rgba(36, 87, 214, ${(0.08 + 0.5 * p).toFixed(3)})`;
  const alternatives = (entry.top_logprobs || []).map((t) => `${JSON.stringify(t.token)} ${t.logprob.toFixed(3)}`);
  chip.title = `${JSON.stringify(entry.token)}: logprob ${entry.logprob.toFixed(4)} (p ${(100 * p).toFixed(1)}%)` +
    (alternatives.length ? `\nalternatives: ${alternatives.join(", ")}` : "");
  const show = () => { ui.tokenInfo.textContent = chip.title.replace("\n", "  ·  "); };
  chip.addEventListener("mouseenter", show);
  chip.addEventListener("click", show);
  strip.append(chip);
}

function showStats(parts) {
  ui.stats.replaceChildren();
  parts.forEach(([label, value], i) => {
    if (i) ui.stats.append("  ·  ");
    const b = document.createElement("b");
    b.textContent = value;
    ui.stats.append(`${label} `, b);
  });
}

function acceptance(accepted, drafted) {
  const pct = drafted ? ` (${(100 * accepted / drafted).toFixed(0)}%)` : "";
  return `${accepted} / ${drafted}${pct}`;
}

// Yield the parsed JSON of each `data:` event of an SSE body until [DONE].
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true}).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

async function errorText(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    message = (await response.json()).error.message || message;
  } catch (e) { /* not JSON */ }
  if (response.status === 401) {
    return `401: this server was started with --api-key; enter its key in the API key field above (${message})`;
  }
  return `${response.status}: ${message}`;
}

async function send() {
  const text = ui.prompt.value;
  if (controller || !text.trim()) return;
  ui.prompt.value = "";
  const messages = [...history, {role: "user", content: text}];
  const system = ui.system.value.trim();
  const body = {
    messages: system ? [{role: "system", content: system}, ...messages] : messages,
    stream: true, stream_options: {include_usage: true},
  };
  if (ui.temperature.value !== "") body.temperature = Number(ui.temperature.value);
  if (ui.maxTokens.value !== "") body.max_tokens = Number(ui.maxTokens.value);  // empty: the room left
  if (ui.jsonMode.checked) body.response_format = {type: "json_object"};
  if (ui.logprobs.checked) Object.assign(body, {logprobs: true, top_logprobs: 5});
  ui.stats.replaceChildren();
  ui.tokenInfo.textContent = "";
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  let strip = null;  // the reply's tokens, with log-probabilities asked for
  if (ui.logprobs.checked) {
    strip = document.createElement("div");
    strip.className = "tokens";
    reply.body.after(strip);
  }
  reply.box.classList.add("streaming");
  controller = new AbortController();
  ui.send.disabled = true;
  ui.stop.disabled = false;
  const headers = {"Content-Type": "application/json"};
  if (ui.key.value.trim()) headers.Authorization = `Bearer ${ui.key.value.trim()}`;
  const sent = performance.now();
  let finish = null;
  let status = "";
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers, body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      const spec = chunk.verispec;
      if (choice && spec) {
        following(() => spec.pieces.forEach((p) => appendPiece(reply.body, p.text, p.draft)));
        const rate = spec.completion_tokens / ((performance.now() - sent) / 1000);
        showStats([["tokens/s", rate.toFixed(1)], ["tokens", spec.completion_tokens],
                   ["accepted / drafted", acceptance(spec.num_accepted_tokens, spec.num_draft_tokens)]]);
      } else if (choice && choice.delta.content) {
        following(() => appendPiece(reply.body, choice.delta.content, false));  // a server without the field
      }
      if (strip && choice && choice.logprobs) {
        following(() => (choice.logprobs.content || []).forEach((entry) => addToken(strip, entry)));
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (chunk.usage) {
        const u = chunk.usage;
        const m = (chunk.metrics || {}).speculative_decoding || {};
        const seconds = (performance.now() - sent) / 1000;
        showStats([["tokens/s", (u.completion_tokens / seconds).toFixed(1)],
                   ["usage", `${u.prompt_tokens} prompt + ${u.completion_tokens} completion tokens`],
                   ["accepted / drafted", acceptance(m.num_accepted_tokens || 0, m.num_draft_tokens || 0)],
                   ["mean acceptance length", (m.mean_acceptance_length || 1).toFixed(2)],
                   ["time", `${seconds.toFixed(2)} s`]]);
      }
    }
    status = `finished: ${finish || "?"}`;
  } catch (e) {
    if (e.name === "AbortError") {
      status = "stopped";
    } else {
      reply.box.classList.add("error");
      status = e.message;
    }
  } finally {
    controller = null;
    ui.send.disabled = false;
    ui.stop.disabled = true;
    reply.box.classList.remove("streaming");
    reply.box.classList.add("done");
    following(() => { reply.note.textContent = status; });
    ui.prompt.focus();
  }
  if (reply.box.isConnected && !reply.box.classList.contains("error")) {  // not cleared by New chat
    history = [...messages, {role: "assistant", content: reply.body.textContent}];
  }
}
