// Conversation inspector: plain JS, no build step. Reads /ui/api/* with the gateway key.
"use strict";
const $ = (sel, root = document) => root.querySelector(sel);
let key = localStorage.getItem("gateway-key") || "";
let pollTimer = null;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

async function api(path) {
  const headers = key ? { Authorization: "Bearer " + key } : {};
  const response = await fetch(path, { headers });
  if (response.status === 401) {
    $("#key-form").hidden = false;
    throw new Error("a gateway key is needed");
  }
  if (!response.ok) throw new Error((await response.json()).error?.message || response.statusText);
  return response.json();
}

function when(ts) { return ts ? new Date(ts * 1000).toLocaleString() : "–"; }
function textOf(message) {
  if (!message) return "";
  let text = typeof message.content === "string" ? message.content
    : Array.isArray(message.content) ? message.content.map(p => p.text || `[${p.type}]`).join(" ") : "";
  for (const call of message.tool_calls || []) text += `\n→ ${call.function?.name}(${call.function?.arguments}) [${call.id}]`;
  if (message.role === "tool") text = `[${message.tool_call_id}] ` + text;
  return text;
}
function bubble(message, extra = "") {
  const role = message.role || "unknown";
  const label = role + (message.is_feedback ? " · feedback (not replayed)" : "")
    + (message.compaction ? " · compaction item sent back: the summary it stands for" : "");
  return el("div", { class: `msg ${role} ${message.is_feedback ? "feedback" : ""} ${message.compaction ? "compaction" : ""} ${extra}` },
    el("span", { class: "role", text: label }), textOf(message));
}

// Where a compaction happened: after the turn it covers through.
function compactionMark(c) {
  const why = c.trigger === "context_management"
    ? `context_management: from here on the window starts with summary v${c.summary_version}`
    : "POST /v1/responses/compact: the conversation itself goes on unchanged";
  return el("div", { class: "marker-compaction", text: `⧉ compaction ${c.id}: the ${c.covered_messages} messages through ${c.covers_through} summarized (${why}) ${when(c.created)}` });
}
function withCompactions(cards, turns, compactions) {
  const out = [];
  cards.forEach((card, i) => {
    out.push(card);
    for (const c of compactions || []) if (turns[i].response_id && c.covers_through === turns[i].response_id) out.push(compactionMark(c));
  });
  return out;
}

// -- list -----------------------------------------------------------------------------------
// One request reads a bounded number of conversations (newest first); "older" goes on from `next`.
let listed = { rows: [], next: null };
let listAsked = 0;  // the latest list asked for: an answer to an earlier one (a search typed over) is dropped

async function showList(more = false) {
  stopPolling();
  current = { id: null, count: 0, entries: 0, compactions: 0 };
  $("#conversation-view").hidden = true;
  $("#list-view").hidden = false;
  const q = $("#search").value.trim();
  const params = new URLSearchParams();
  if (q) params.set("q", q);
  if (more && listed.next) params.set("after", listed.next);
  const asked = ++listAsked;
  try {
    const { data, next } = await api("/ui/api/conversations" + (params.size ? "?" + params : ""));
    if (asked !== listAsked) return;
    listed = { rows: more ? listed.rows.concat(data) : data, next: next || null };
    const body = $("#conversation-list tbody");
    body.replaceChildren(...listed.rows.map(c => el("tr", { class: "conv-row", "data-id": c.id, onclick: () => { location.hash = "#/c/" + encodeURIComponent(c.id); } },
      el("td", {}, el("a", { href: "#/c/" + encodeURIComponent(c.id), text: c.id })),
      el("td", { text: c.user || "–" }), el("td", { text: c.turns }), el("td", { text: c.messages }),
      el("td", { text: c.tokens }), el("td", { text: when(c.last_activity) }),
      el("td", {}, el("span", { class: "state " + c.state, text: c.state })),
      el("td", { class: "preview", text: c.preview }))));
    const n = listed.rows.length;
    const count = $("#list-count");
    count.replaceChildren(`${n} conversation${n === 1 ? "" : "s"}`);
    if (listed.next) {
      count.append(" · ", el("a", { href: "#", id: "list-more", text: q ? "search older conversations" : "older",
        onclick: (e) => { e.preventDefault(); showList(true); } }));
    }
    status("");
  } catch (e) { if (asked === listAsked) status(e.message); }
}

// -- one conversation -------------------------------------------------------------------------
let current = { id: null, count: 0, entries: 0, compactions: 0 };

function bar(context, cache) {
  const windowSize = context.context_window || 1;
  const tokens = context.tokens || {};
  const layers = ["system", "summary", "recap", "history", "marker", "tools", "new", "overhead"];
  const used = layers.reduce((s, l) => s + (tokens[l] || 0), 0);
  const node = el("div", { class: "bar", title: `${used} of ${windowSize} tokens; budget ${context.budget}` });
  for (const layer of layers) {
    const n = tokens[layer] || 0;
    if (n) node.append(el("div", { class: "seg-" + layer, style: `width:${(100 * n / windowSize).toFixed(3)}%`, title: `${layer}: ${n} tokens` }));
  }
  node.append(el("div", { class: "seg-free", style: `flex:1`, title: `free: ${Math.max(0, windowSize - used)} tokens` }));
  node.append(el("div", { class: "budget", style: `left:${(100 * (context.budget || 0) / windowSize).toFixed(3)}%`, title: `budget ${context.budget}` }));
  // The head of the prompt the provider's cache served (its share of the prompt, in the provider's count).
  if (cache && cache.cached_tokens != null && cache.prompt_tokens) {
    const share = Math.min(1, cache.cached_tokens / cache.prompt_tokens);
    node.append(el("div", { class: "cached", style: `width:${(100 * share * used / windowSize).toFixed(3)}%`, title: `cached: ${cache.cached_tokens} of ${cache.prompt_tokens} prompt tokens from the provider's cache` }));
  }
  return node;
}

// Where each branch starts: "responseId:position" of the first message it left behind -> its turn.
function branchPoints(turns) {
  const points = new Map();
  for (const t of turns) if (t.branch_left) points.set(`${t.branch_left.response_id}:${t.branch_left.position}`, t);
  return points;
}

function branchWords(turn) {
  const after = `continues after message ${turn.branch_at}`;
  if (turn.branch === "regenerated") return `regenerated: the same message asked again for a new answer (${after})`;
  if (turn.branch === "edited") return `edited: the client's version of the conversation branches here (${after})`;
  return `the client's version of the conversation branches here (${after})`;
}

function turnCard(turn, isNew, points = new Map()) {
  if (turn.marker === "reset") return el("div", { class: "marker-reset", text: `— conversation reset ${when(turn.at)} —` });
  if (turn.marker === "delete_item") {
    const part = turn.call !== undefined ? `call ${turn.call} of ` : turn.text ? "the text of " : "";
    return el("div", { class: "marker-reset", text: `— ${part}item ${turn.position} of ${turn.response_id} deleted ${when(turn.at)} —` });
  }
  if (turn.marker === "delete_response") return el("div", { class: "marker-reset", text: `— response ${turn.response_id} deleted ${when(turn.at)} —` });
  const card = el("div", { class: "turn" + (isNew ? " new-turn" : ""), "data-response-id": turn.response_id });
  const ctx = turn.context || {};
  card.append(el("div", { class: "turn-head" },
    el("span", { text: `#${turn.index + 1} · ${turn.response_id} · ${turn.model || turn.kind}` }),
    el("span", { text: when(turn.created) + (turn.outcome !== "commit" ? " · " + turn.outcome : "") })));
  // Messages the model no longer gets (deleted, left behind by a branch, a tool result whose call was deleted).
  const notSent = new Set(turn.not_sent || []);
  // (a system prompt's messages have positions -1, -2, ...: struck once deleted or replaced)
  // The reason (`not_sent_why`) is the one `gateway show` prints.
  const why = turn.not_sent_why || {};
  // Parts of an answer deleted alone (its text, a call): the rest of it is still sent.
  const parts = turn.not_sent_parts || {};
  const mark = (m, pos, extra = "") => {
    const b = bubble(m, extra + (notSent.has(pos) ? " not-sent" : ""));
    if (notSent.has(pos)) b.title = `${why[pos] || "no longer sent"}: no longer sent to the model`;
    if (parts[pos]) b.append(el("div", { class: "part-deleted", text: `(${parts[pos].join(", ")} deleted: no longer sent)` }));
    return b;
  };
  // Where a branch starts: this turn's first message when it branched, and the message a later
  // branch left behind (struck through with what followed it).
  const branched = (m, pos) => {
    const out = [];
    let extra = "";
    if (turn.branch_at != null && pos === 0) {
      out.push(el("div", { class: "branch-note", text: "↪ " + branchWords(turn) }));
      extra += " branch-start";
    }
    const later = points.get(`${turn.response_id}:${pos}`);
    if (later) {
      out.push(el("div", { class: "branch-note", text: `↪ the branch of #${later.index + 1} (${later.branch || "branched"}) leaves from here: this and what followed are no longer sent` }));
      extra += " branch-point";
    }
    return [...out, mark(m, pos, extra)];
  };
  (turn.system || []).forEach((m, i) => card.append(mark(m, -(i + 1), "new-system")));
  turn.input.forEach((m, i) => card.append(...branched(m, i)));
  if (turn.output) card.append(...branched(turn.output, turn.input.length));
  if (ctx.tokens) {
    card.append(bar(ctx, turn.cache));
    const facts = el("div", { class: "facts" });
    const t = ctx.tokens;
    facts.append(el("span", { text: `window ${ctx.context_window} · budget ${ctx.budget} · sent ${t.total} tokens in ${ctx.sent_messages} messages` }));
    facts.append(ctx.truncated ? el("span", { class: "omitted", text: `${ctx.truncated} earlier messages omitted` }) : el("span", { text: "nothing omitted" }));
    if (ctx.summary_version != null) facts.append(el("span", { text: `summary v${ctx.summary_version} covers ${ctx.summary_covers_messages} messages` }));
    if (ctx.recap) facts.append(el("span", { text: "recap: " + (ctx.recap_conversations || []).join(", ") }));
    if (turn.timings) facts.append(el("span", { text: `upstream ${turn.timings.upstream_ms} ms · total ${turn.timings.total_ms} ms` }));
    if (turn.usage) facts.append(el("span", { text: `usage ${turn.usage.prompt_tokens ?? "?"} in / ${turn.usage.completion_tokens ?? "?"} out` }));
    if (turn.cache && turn.cache.cached_tokens != null) facts.append(el("span", { class: "cache", text: `cache ${turn.cache.cached_tokens} of ${turn.cache.prompt_tokens ?? "?"} prompt tokens` + (turn.cache.cache_creation_tokens ? ` · ${turn.cache.cache_creation_tokens} written` : "") }));
    if (turn.suspected_truncation) facts.append(el("span", { class: "warn", text: `⚠ upstream truncation suspected (${turn.suspected_truncation.prompt_tokens} vs ${turn.suspected_truncation.our_count})` }));
    card.append(facts);
  }
  if (turn.sent && turn.sent.length) {
    // Drawn when first asked for: a long conversation holds its window once per turn.
    const list = el("div", { class: "sent-list", hidden: "" });
    card.append(el("button", { class: "toggle-sent", onclick: (e) => {
      if (!list.childElementCount) list.append(...turn.sent.map(m => bubble(m)));
      list.hidden = !list.hidden; e.target.textContent = list.hidden ? "what was sent" : "hide what was sent"; } , text: "what was sent" }), list);
  }
  return card;
}

async function showConversation(id) {
  stopPolling();
  $("#list-view").hidden = true;
  $("#conversation-view").hidden = false;
  current = { id, count: 0, entries: 0, compactions: 0 };
  $("#turns").replaceChildren();
  try {
    const data = await conversationData(id, 0);
    if (id !== current.id) return;  // (another conversation, or the list, was opened meanwhile)
    render(data);
    status("live");
    stopPolling();
    pollTimer = setInterval(poll, 1000);
  } catch (e) { if (id === current.id) status(e.message); }
}

// A conversation's turns from turn `since` on, each with its whole sent list: the answer says
// each list as what it shares with the turn's before it and the rest (`?sent=delta`).
async function conversationData(id, since) {
  const data = await api(`/ui/api/conversations/${encodeURIComponent(id)}?since=${since}&sent=delta`);
  let before = [];
  for (const turn of data.turns) {
    if (!Array.isArray(turn.sent_tail)) continue;  // (a marker)
    turn.sent = before.slice(0, turn.sent_shared).concat(turn.sent_tail);
    before = turn.sent;
  }
  return data;
}

// The whole conversation drawn again (what the model no longer gets may have changed).
function render(data) {
  const y = window.scrollY;
  renderHead(data);
  const points = branchPoints(data.turns);
  const cards = data.turns.map(turn => turnCard(turn, false, points));
  $("#turns").replaceChildren(...withCompactions(cards, data.turns, data.compactions));
  current.count = data.count;
  current.entries = data.entries;
  current.compactions = (data.compactions || []).length;
  window.scrollTo(0, y);
}

function renderHead(data) {
  const head = $("#conversation-head");
  head.replaceChildren(el("h1", { text: data.id }),
    el("div", { class: "muted" }, `state `, el("span", { class: "state " + data.state, text: data.state }),
      data.user ? ` · user ${data.user}` : "", Object.keys(data.metadata || {}).length ? ` · metadata ${JSON.stringify(data.metadata)}` : ""));
  // The summary the next turn would send: the newest that still applies (deletions withdraw some).
  const applying = (data.summaries || []).filter(s => s.applies !== false).slice(-1);
  for (const s of applying) {
    head.append(el("div", { class: "summary-box" }, el("b", { text: `Summary v${s.version} (covers ${s.covered_messages} messages, through ${s.covers_through}): ` }), s.text));
  }
  if (!applying.length && (data.summaries || []).length) {
    head.append(el("div", { class: "summary-box muted", text: "No summary applies now (withdrawn after a deletion, or of an abandoned branch); truncation applies until a new one is made." }));
  }
}

async function poll() {
  const id = current.id;
  if (!id) return;
  try {
    const data = await conversationData(id, current.count);
    if (id !== current.id) return;  // (another conversation was opened meanwhile)
    status("live");  // (after a failed poll: it answers again)
    renderHead(data);
    const compacted = (data.compactions || []).length !== current.compactions;
    if (data.entries === current.entries && !compacted) return;  // nothing new in its index
    // A reset, a deletion or an edit changes what earlier turns still send, and a compaction
    // is marked after a turn already drawn: draw them all again.
    if (compacted || data.entries !== current.entries + data.turns.length || data.turns.some(t => t.marker || t.branch_at != null)) {
      const whole = await conversationData(id, 0);
      if (id === current.id) render(whole);
      return;
    }
    for (const turn of data.turns) $("#turns").append(turnCard(turn, true));
    current.count = data.count;
    current.entries = data.entries;
  } catch (e) { if (id === current.id) status(e.message); }
}

function stopPolling() { if (pollTimer) clearInterval(pollTimer); pollTimer = null; }
function status(text) { $("#status").textContent = text; }

function route() {
  const match = location.hash.match(/^#\/c\/(.+)$/);
  if (!match) { showList(); return; }
  let id;
  try { id = decodeURIComponent(match[1]); } catch {
    // A malformed escape (%E0%A4%A): said, and nothing of another conversation left on screen.
    stopPolling();
    current = { id: null, count: 0, entries: 0, compactions: 0 };
    $("#list-view").hidden = true;
    $("#conversation-view").hidden = true;
    status("Invalid conversation id in the address: " + match[1]);
    return;
  }
  showConversation(id);
}

$("#key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  key = $("#key-input").value.trim();
  localStorage.setItem("gateway-key", key);
  $("#key-form").hidden = true;
  route();
});
let searchTimer = null;
$("#search").addEventListener("input", () => { clearTimeout(searchTimer); searchTimer = setTimeout(showList, 200); });
window.addEventListener("hashchange", route);
route();
