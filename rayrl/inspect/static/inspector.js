"use strict";
// rayrl inspector: one page, two data sources. Served (python -m rayrl.inspect RUN_DIR) it asks the
// server's JSON API; exported (--export FILE.html) it reads the same JSON embedded in the page.
// Every text from the run is put into the page with textContent, never parsed as HTML.

const EMBEDDED = document.getElementById("rayrl-data");
const STATIC = EMBEDDED ? JSON.parse(EMBEDDED.textContent) : null;
const TOKEN = new URLSearchParams(location.search).get("token");
const $ = (id) => document.getElementById(id);
let RUN = null, CURRENT = null, EPISODE = null;

async function api(path, params) {
  if (STATIC) {
    if (path === "run") return STATIC.run;
    const detail = STATIC.details[params.step + ":" + params.index];
    if (!detail) throw new Error("this export holds no detail for episode " + params.step + ":" + params.index);
    return detail;
  }
  const q = new URLSearchParams(params || {});
  if (TOKEN) q.set("token", TOKEN);
  const r = await fetch("api/" + path + "?" + q);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
  return body;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v); else node.setAttribute(k, v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}
const fmt = (v, d = 3) => v == null ? "" : (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(d)) : String(v));

// ---------------------------------------------------------------- run, charts, list
const CHARTS = [
  ["reward", (m) => m["rollout/reward_mean"]],
  ["success rate", (m) => m["rollout/success_rate"]],
  ["length (generated tokens / episode)", (m) => m["rollout/episodes"] ? m["rollout/generated_tokens"] / m["rollout/episodes"] : null],
  ["staleness (mean versions)", (m) => m["pipeline/staleness_mean"]],
  ["dropped samples (stale)", (m) => m["pipeline/dropped_stale_samples"] || 0],
  // engine-trainer gap over fresh trained tokens (rayrl/rl/logprob_gap.py): engine numerics, not staleness
  ["engine-trainer gap: mean |Δ log-prob|", (m) => m["train/engine_gap/mean_abs"]],
  ["engine-trainer gap: max |Δ log-prob|", (m) => m["train/engine_gap/max_abs"]],
  ["engine-trainer gap: KL(engine ‖ trainer)", (m) => m["train/engine_gap/kl"]],
];

function chart(title, points) {
  const W = 220, H = 90, P = 22;
  const fig = el("figure", {class: "chart", "data-title": title}, el("figcaption", {text: title}));
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  const ys = points.map((p) => p[1]);
  if (!points.length) { fig.append(el("div", {text: "no data yet"})); return fig; }
  const x0 = points[0][0], x1 = points[points.length - 1][0];
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const sx = (x) => P + (x1 === x0 ? (W - 2 * P) / 2 : (x - x0) / (x1 - x0) * (W - 2 * P));
  const sy = (y) => H - P + 8 - (y - y0) / (y1 - y0) * (H - P - 4);
  const ns = (tag, a) => { const n = document.createElementNS(svg.namespaceURI, tag); for (const k in a) n.setAttribute(k, a[k]); return n; };
  svg.append(ns("polyline", {class: "line", points: points.map((p) => sx(p[0]) + "," + sy(p[1])).join(" ")}));
  for (const p of points) { const c = ns("circle", {class: "dot", cx: sx(p[0]), cy: sy(p[1]), r: 2}); c.append(ns("title", {})); c.firstChild.textContent = "step " + p[0] + ": " + fmt(p[1]); svg.append(c); }
  const label = (x, y, t, anchor) => { const n = ns("text", {x, y, "text-anchor": anchor || "start"}); n.textContent = t; svg.append(n); };
  label(2, 10, fmt(y1)); label(2, H - 4, fmt(y0)); label(W - 2, H - 4, "step " + x1, "end");
  fig.append(svg);
  return fig;
}

function renderCharts() {
  const box = $("charts"); box.replaceChildren();
  for (const [title, f] of CHARTS) {
    const pts = RUN.metrics.map((m) => [m.step, f(m)]).filter((p) => typeof p[1] === "number" && isFinite(p[1]));
    box.append(chart(title, pts));
  }
}

function fillSelect(id, values) {
  const s = $(id), keep = s.value;
  s.replaceChildren(el("option", {value: "", text: "all"}), ...values.map((v) => el("option", {value: String(v), text: String(v)})));
  s.value = values.map(String).includes(keep) ? keep : "";
}

// the silent-failure guards (rayrl/rl/guards.py): the last step's figures, and each crossing with its example
function renderGuards() {
  const last = [...RUN.metrics].reverse().find((m) => Object.keys(m).some((k) => k.startsWith("guards/")));
  const crossings = RUN.guards || [];
  $("guards").hidden = !last && !crossings.length;
  const figures = last ? Object.keys(last).filter((k) => k.startsWith("guards/") && k !== "guards/fired").sort() : [];
  $("guard-figures").replaceChildren(...(last ? [el("span", {text: "step " + last.step + ": "})] : []),
    ...figures.map((k) => el("span", {class: "guard-figure", text: k.slice(7) + " " + fmt(last[k]) + "  "})));
  $("guard-crossings").replaceChildren(...crossings.map((c) => {
    const what = "step " + c.step + " · " + c.guard + " (" + c.action + "): " + fmt(c.value) + " of " + c.count + " " + c.what
      + ", threshold " + c.threshold;
    const item = el("li", {class: c.action === "stop" ? "guard-stop" : "guard-warn", text: what + " "});
    if (c.key) item.append(el("a", {href: "#episode=" + c.key, text: "example episode " + c.key}));
    else if (c.session_id) item.append(el("span", {text: "example session " + c.session_id}));
    return item;
  }));
}

function renderRun() {
  $("run-title").textContent = "— " + RUN.exp_id;
  $("run-meta").textContent = [RUN.model, RUN.steps.length + " steps", RUN.episodes.length + " episodes", STATIC ? "static export" : RUN.path].filter(Boolean).join(" · ");
  $("problems").hidden = !RUN.problems.length;
  $("problems").textContent = RUN.problems.length ? "Problems reading this run:\n" + RUN.problems.join("\n") : "";
  fillSelect("f-step", RUN.steps);
  fillSelect("f-status", [...new Set(RUN.episodes.map((e) => e.status))].sort());
  fillSelect("f-harness", [...new Set(RUN.episodes.map((e) => e.harness).filter(Boolean))].sort());
  renderGuards();
  renderCharts();
  renderList();
}

function visible() {
  const step = $("f-step").value, status = $("f-status").value, harness = $("f-harness").value;
  const rmin = $("f-reward").value, lmin = $("f-length").value, q = $("f-search").value.trim().toLowerCase();
  const key = $("f-sort").value, desc = $("f-desc").checked;
  const rows = RUN.episodes.filter((e) =>
    (!step || String(e.step) === step) && (!status || e.status === status) && (!harness || e.harness === harness) &&
    (rmin === "" || e.reward >= Number(rmin)) && (lmin === "" || (e.tokens || 0) >= Number(lmin)) &&
    (!q || [e.task_id, e.prompt, e.final_answer, e.error, e.failure, e.session_id, e.group_id].join("\n").toLowerCase().includes(q)));
  const val = (e) => key === "step" ? e.step * 1e6 + e.index : (e[key] == null ? -Infinity : e[key]);
  rows.sort((a, b) => (val(a) - val(b)) * (desc ? -1 : 1));
  return rows;
}

function renderList() {
  const rows = visible();
  $("count").textContent = rows.length + " of " + RUN.episodes.length + " episodes";
  const body = $("episodes").tBodies[0];
  body.replaceChildren(...rows.map((e) => el("tr", {"data-key": e.key, class: e.key === CURRENT ? "current" : "", onclick: () => openEpisode(e.step, e.index)},
    el("td", {text: e.step}), el("td", {text: e.index}),
    el("td", {class: "task", text: (e.task_id || "") + (e.prompt ? " — " + e.prompt.slice(0, 120) : "")}),
    el("td", {text: e.harness || ""}), el("td", {class: "status-" + e.status, text: e.status + (e.failure ? " · " + e.failure : "") + (e.discarded ? " · set aside (" + e.discarded + ")" : "")}),
    el("td", {text: fmt(e.reward)}), el("td", {text: fmt(e.advantage)}), el("td", {text: fmt(e.turns)}),
    el("td", {text: fmt(e.tool_errors)}), el("td", {text: fmt(e.tokens)}),
    el("td", {text: fmt((e.timings || {}).total_s, 1)}), el("td", {text: e.detail ? "tokens" : "tree"}))));
}

// ---------------------------------------------------------------- one episode
// One episode has its own address: the page's URL with #episode=STEP:INDEX (served or exported) opens it.
const EPISODE_HASH = /^#episode=(\d+):(\d+)$/;
function episodeLink(key) { return location.href.split("#")[0] + "#episode=" + key; }

async function openEpisode(step, index) {
  CURRENT = step + ":" + index;
  if (location.hash !== "#episode=" + CURRENT) history.replaceState(null, "", "#episode=" + CURRENT);
  renderList();
  try { EPISODE = await api("episode", {step, index}); }
  catch (err) { $("episode").hidden = false; $("ep-title").textContent = "Episode " + CURRENT; $("ep-problem").hidden = false; $("ep-problem").textContent = String(err.message || err); return; }
  renderEpisode();
}

function judgeLine(calls) {  // rollout.judge's calls for this episode: how many, tokens, latency, retries
  if (!calls || !calls.length) return null;
  const ok = calls.filter((c) => c.ok), tokens = ok.reduce((t, c) => t + (c.prompt_tokens || 0) + (c.completion_tokens || 0), 0);
  return calls.length + " (" + (calls.length - ok.length) + " failed), " + tokens + " tokens, " +
    calls.map((c) => fmt(c.latency_s, 2) + " s" + (c.attempts > 1 ? " after " + c.attempts + " attempts" : "")).join(", ");
}

function renderEpisode() {
  const d = EPISODE, r = d.row;
  $("episode").hidden = false;
  $("ep-title").textContent = "Episode " + r.key + " — " + (r.task_id || "") + " (" + r.status + ")";
  $("ep-link").href = episodeLink(r.key); $("ep-link").hidden = false;
  const items = [["session", r.session_id], ["task", r.task_id], ["prompt", r.prompt], ["group", r.group_id], ["harness", r.harness],
    ["status", r.status + (r.agent_status ? " (agent: " + r.agent_status + ")" : "")], ["failure", r.failure], ["error", r.error],
    ["set aside", r.discarded ? (r.discarded === "rerun" ? "its group ran again (infrastructure failures); not trained" : "its group was too stale; not trained") : null], ["reward", fmt(r.reward)],
    ["reward by function", Object.entries(r.reward_breakdown || {}).map(([k, v]) => k + " " + fmt(v)).join(", ")],
    ["judge calls", judgeLine(r.judge_calls)],
    ["advantage", fmt(r.advantage)], ["turns / tool calls / tool errors", [r.turns, r.tool_calls, r.tool_errors].map(fmt).join(" / ")],
    ["final answer", r.final_answer], ["timings (s)", Object.entries(r.timings || {}).map(([k, v]) => k + " " + fmt(v, 2)).join(", ")]];
  $("ep-summary").replaceChildren(...items.filter((i) => i[1] != null && i[1] !== "").flatMap(([k, v]) => [el("dt", {text: k}), el("dd", {text: v})]));
  $("ep-problem").hidden = !d.problem; $("ep-problem").textContent = d.problem || "";
  for (const part of [renderTree, renderSamples]) {
    try { part(); }  // a damaged record shows what it can and says what failed
    catch (err) { $("ep-problem").hidden = false; $("ep-problem").textContent += (d.problem ? "; " : "") + "could not draw this episode's data: " + (err.message || err); }
  }
  $("episode").scrollIntoView();
}

function nodeLine(n) {
  const g = n.gen, box = el("div", {class: "node role-" + n.role + (g ? " gen" : ""), "data-node": n.id});
  box.append(el("span", {class: "role", text: n.role}));
  if (n.branch === "root") box.append(el("span", {class: "badge branch", text: "new branch (sub-agent / compaction)"}));
  if (n.branch === "fork") box.append(el("span", {class: "badge branch", text: "fork"}));
  if (g) {
    box.setAttribute("data-turn", g.turn);
    box.append(el("span", {class: "badge call", text: "LLM call #" + g.turn}),
      el("span", {class: "badge", text: "v" + (Array.isArray(g.version) ? g.version.join("→") : g.version)}),
      el("span", {class: "badge", text: "prompt " + g.prompt_len + " · response " + g.response_len + " · " + g.finish_reason}));
    if (g.merged) box.append(el("span", {class: "badge merged", title: "fork-merge: the client re-rendered this message; the rewrite was merged onto this node, which trains nothing", text: "fork-merge"}));
    if (g.retry) box.append(el("span", {class: "badge retry", text: "retry"}));
    if (g.drift) box.append(el("span", {class: "badge drift", title: "TITO drift: this call's prompt differs from call #" + g.drift.prev_turn + "'s tokens at token " + g.drift.position + "; linearization splits the sample there (or masks, as trajectory.on_drift says)", text: "drift: " + g.drift.kind + " @ " + g.drift.position}));
    box.addEventListener("click", () => highlightTurn(g.turn, n.id));
  } else if (n.call != null) {
    box.append(el("span", {class: "badge", text: "from LLM call #" + n.call + (n.calls > 1 ? " · " + n.calls + " calls below" : "")}));
  }
  const calls = (n.tool_calls || []).map((c) => c.name + "(" + c.arguments + ")").join("; ");
  const text = (n.text || "") + (calls ? (n.text ? "\n" : "") + "tool calls: " + calls : "") + (n.chars > (n.text || "").length ? " …[" + n.chars + " chars]" : "");
  box.append(el("div", {class: "text", text: text.length > 600 ? text.slice(0, 600) + " …" : text}));
  return box;
}

function renderTree() {
  const box = $("tree");
  if (!EPISODE.tree) { box.replaceChildren(el("div", {text: "no tree recorded"})); return; }
  const nodes = EPISODE.tree.nodes, kids = new Map();
  for (const n of nodes) { const p = n.parent == null ? -1 : n.parent; if (!kids.has(p)) kids.set(p, []); kids.get(p).push(n); }
  // a conversation stays flat; only where the tree splits do the branches indent (deep sessions stay shallow)
  const build = (parent) => el("ul", {}, ...(kids.get(parent) || []).map((first) => {
    const li = el("li");
    for (let n = first; n;) {
      li.append(nodeLine(n));
      const next = kids.get(n.id) || [];
      if (next.length > 1) li.append(build(n.id));
      n = next.length === 1 ? next[0] : null;
    }
    return li;
  }));
  const s = EPISODE.tree.stats || {};
  box.replaceChildren(el("div", {text: [s.turns + " LLM calls", s.root_branches + " top-level branch(es)", s.forks + " forks", s.merged_rewrites + " fork-merges",
    Object.entries(s.drift || {}).filter((x) => x[1]).map(([k, v]) => v + " drift " + k).join(", ")].filter(Boolean).join(" · ")}), build(-1));
}

const expand = (runs) => runs.flatMap(([v, n]) => Array(n).fill(v));
function lcp(a, b) { let i = 0; while (i < a.length && i < b.length && a[i] === b[i]) i++; return i; }

function renderSamples() {
  const box = $("samples"), samples = EPISODE.samples, raw = $("raw-ids").checked;
  if (!samples) { box.replaceChildren(el("div", {text: "token detail was not kept for this episode (only the first logging.inspect_episodes_per_step episodes of a step keep it)"})); return; }
  const gens = new Map((EPISODE.tree ? EPISODE.tree.nodes : []).filter((n) => n.gen).map((n) => [n.gen.turn, n]));
  box.replaceChildren(...samples.map((s, k) => {
    const mask = expand(s.mask), versions = expand(s.versions), P = s.prompt_length, toks = s.tokens;
    const callAt = new Array(toks.length).fill(null);
    for (const t of s.turns) { const g = gens.get(t); if (g) for (let i = g.gen.prompt_len; i < g.gen.prompt_len + g.gen.response_len && i < toks.length; i++) callAt[i] = t; }
    let best = [-1, 0];
    for (let j = 0; j < k; j++) { const n = lcp(toks, samples[j].tokens); if (n > best[1]) best = [j, n]; }
    const trained = mask.filter((m) => m === 1).length;
    const head = el("h4", {text: "Sample " + k + " · leaf " + s.leaf + " · LLM calls " + s.turns.map((t) => "#" + t).join(" ") + " · " + toks.length + " tokens (" + P + " prompt, " + trained + " trained, " + (mask.length - trained) + " masked) · reward " + fmt(s.reward) + " · advantage " + fmt(s.advantage) + " · " + s.status});
    const notes = [];
    if (s.drift) notes.push(el("div", {class: "note drift", text: "Starts at a TITO drift (" + s.drift.kind + "): LLM call #" + s.drift.turn + "'s prompt differs from call #" + s.drift.prev_turn + "'s tokens at token " + s.drift.position}));
    if (s.merged_turns) notes.push(el("div", {class: "note", text: s.merged_turns + " fork-merged turn(s) before its calls: their tokens train nothing"}));
    if (best[0] >= 0) notes.push(el("div", {class: "note diverge-note", text: "Shares its first " + best[1] + " tokens with sample " + best[0] + "; diverges at token " + best[1]}));
    const line = el("div", {class: "tokens", "data-sample": k});
    toks.forEach((id, i) => {
      const r = i - P, kind = r < 0 ? "prompt" : (mask[r] ? "trained" : "masked");
      let cls = "tok " + kind;
      if (best[0] >= 0 && i === best[1]) cls += " diverge";
      if (s.drift && i === s.drift.position) cls += " drift-at";
      const text = raw ? "[" + id + "]" : (EPISODE.vocab[String(id)] ?? "[" + id + "]");
      line.append(el("span", {class: cls, "data-i": i, "data-call": callAt[i] ?? "", text}));
    });
    line.addEventListener("click", (ev) => { const t = ev.target.closest(".tok"); if (t) tokenInfo(s, k, Number(t.dataset.i), mask, versions); });
    line.addEventListener("mouseover", (ev) => { const t = ev.target.closest(".tok"); if (t && !t.title) t.title = tokenText(s, Number(t.dataset.i), mask, versions, callAt); });
    s._callAt = callAt;
    return el("div", {class: "sample"}, head, ...notes, line);
  }));
}

function tokenText(s, i, mask, versions, callAt) {
  const r = i - s.prompt_length, id = s.tokens[i];
  const parts = ["token " + i, "id " + id, JSON.stringify(EPISODE.vocab[String(id)] ?? "")];
  if (r < 0) parts.push("prompt (not trained)");
  else {
    parts.push(mask[r] ? "trained" : "masked", "policy v" + versions[r], "rollout logprob " + fmt(s.logprobs[r], 4));
    if (s.trainer_logprobs) parts.push("trainer logprob " + fmt(s.trainer_logprobs[r], 4));
    parts.push("advantage " + fmt(s.advantage));
    if (callAt[i] != null) parts.push("LLM call #" + callAt[i]);
  }
  return parts.join(" · ");
}

function tokenInfo(s, k, i, mask, versions) {
  $("token-info").textContent = "sample " + k + " · " + tokenText(s, i, mask, versions, s._callAt);
  const call = s._callAt[i];
  document.querySelectorAll(".node.sel").forEach((n) => n.classList.remove("sel"));
  if (call != null) { const n = document.querySelector('.node[data-turn="' + call + '"]'); if (n) { n.classList.add("sel"); n.scrollIntoView({block: "nearest"}); } }
}

function highlightTurn(turn, nodeId) {
  document.querySelectorAll(".tok.hl").forEach((t) => t.classList.remove("hl"));
  document.querySelectorAll(".node.sel").forEach((n) => n.classList.remove("sel"));
  document.querySelector('.node[data-node="' + nodeId + '"]').classList.add("sel");
  const toks = document.querySelectorAll('.tok[data-call="' + turn + '"]');
  toks.forEach((t) => t.classList.add("hl"));
  if (toks.length) toks[0].scrollIntoView({block: "nearest"});
}

// ---------------------------------------------------------------- start
async function loadRun() {
  try {
    const run = await api("run");
    if (RUN && run.stamp === RUN.stamp) return;  // nothing changed on disk: keep the page as it is
    const first = !RUN;
    RUN = run; renderRun();
    if (first) openFromHash();
  }
  catch (err) { $("problems").hidden = false; $("problems").textContent = "Could not read the run: " + (err.message || err); }
}
function openFromHash() {
  const m = EPISODE_HASH.exec(location.hash);
  if (m && m[1] + ":" + m[2] !== CURRENT) openEpisode(Number(m[1]), Number(m[2]));
}
window.addEventListener("hashchange", openFromHash);
for (const id of ["f-step", "f-status", "f-harness", "f-reward", "f-length", "f-search", "f-sort", "f-desc"]) $(id).addEventListener("input", renderList);
$("raw-ids").addEventListener("change", () => EPISODE && renderSamples());
if (!STATIC) {
  $("live-box").hidden = false;
  setInterval(() => { if ($("live").checked) loadRun(); }, 5000);
}
loadRun();
