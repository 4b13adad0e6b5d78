// The control plane's own live page: no framework, no CDN, everything from this server.
"use strict";
const COLORS = ["#58a6ff", "#3fb950", "#d29922", "#bc8cff", "#f85149", "#39c5cf"];
const NOTABLE = new Set(["process", "heal", "quorum", "commit_failed", "checkpoint", "exit", "straggler", "partition", "sdc", "sync"]);
const SDC_BADGE_S = 600;  // a group's latest gradient-check incident stays on its card this long
const series = { loss: new Map(), step_s: new Map() };  // group -> [[step, value]]
const API = "/api/v1";  // protocol/api.py's PREFIX: every path below is relative to it, as there
const $ = (id) => document.getElementById(id);
const esc = (text) => String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const tokenInput = $("token");
tokenInput.value = localStorage.getItem("ftctl-token") || "";
tokenInput.addEventListener("change", () => localStorage.setItem("ftctl-token", tokenInput.value));

function notice(text, ok = false) {
  const n = $("notice");
  n.textContent = text; n.hidden = !text; n.className = ok ? "notice ok" : "notice";
}

async function api(method, path, body) {
  const headers = { "Content-Type": "application/json" };
  if (method !== "GET") {
    if (!tokenInput.value) { notice("Enter the bearer token (ftctl up printed it) to do that."); return null; }
    headers.Authorization = "Bearer " + tokenInput.value;
  }
  const response = await fetch(API + path, { method, headers, body: body ? JSON.stringify(body) : undefined });
  const data = await response.json().catch(() => ({}));
  if (!response.ok) { notice(`${method} ${path}: ${data.detail || response.status}`); return null; }
  return data;
}

const fmt = (v) => (v === null || v === undefined ? "not finite" : Number(v).toPrecision(3));
const age = (ts) => { if (!ts) return "-"; const s = Date.now() / 1000 - ts; return s < 120 ? `${s.toFixed(0)}s` : `${(s / 60).toFixed(0)}m`; };

// Up to DENSE_AT groups each has a card; past it every group is a cell of a heat map (its colour
// is its state), a summary counts the states, and the selected cell's card sits beside the map.
const DENSE_AT = 16;
const CHARTED = 6;  // lines per chart in the dense view: the selected group and the first ones
let selected = null;
let dense = false;

function newCard(group) {
  const card = document.createElement("article");
  card.innerHTML = `<h3><span>group ${group}</span><span class="badge straggler" hidden></span><span class="badge sdc" hidden></span><span class="state"></span></h3><div class="step"></div>
    <div class="meta"></div><div class="why" hidden></div><div class="actions"><button class="kill">Kill</button><button class="ghost drain" title="finish and commit the step, leave, stay down until rejoined">Drain</button><button class="ghost rejoin">Rejoin</button></div>`;
  card.querySelector(".kill").addEventListener("click", () => command(Number(card.dataset.group), "kill"));
  card.querySelector(".drain").addEventListener("click", () => command(Number(card.dataset.group), "drain"));
  card.querySelector(".rejoin").addEventListener("click", () => command(Number(card.dataset.group), "rejoin"));
  return card;
}

function renderGroups(groups) {
  dense = groups.length > DENSE_AT;
  const grid = $("groups");
  grid.className = dense ? "heatmap" : "grid";
  $("selected").hidden = !dense;
  $("summary").hidden = !dense;
  if (dense) return renderHeatmap(grid, groups);
  for (const g of groups) {
    let card = $(`group-${g.group}`);
    if (!card || card.tagName !== "ARTICLE") {
      card?.remove();
      card = newCard(g.group);
      card.id = `group-${g.group}`;
      grid.appendChild(card);
    }
    fillCard(card, g);
  }
}

function renderHeatmap(grid, groups) {
  const counts = {};
  for (const g of groups) {
    counts[g.state] = (counts[g.state] || 0) + 1;
    let cell = $(`group-${g.group}`);
    if (!cell || cell.tagName !== "BUTTON") {
      cell?.remove();
      cell = document.createElement("button");
      cell.id = `group-${g.group}`;
      cell.dataset.group = g.group;
      cell.addEventListener("click", () => { selected = Number(cell.dataset.group); refresh(); });
      grid.appendChild(cell);
    }
    cell.className = `cell ${g.state}${g.straggler ? " straggler" : ""}${g.group === selected ? " selected" : ""}`;
    cell.dataset.state = g.state;
    cell.title = `group ${g.group}: ${g.state}${g.down_reason ? " (" + g.down_reason + ")" : ""} · step ${g.step ?? "-"}` +
      `${g.straggler ? " · straggler" : ""}`;
  }
  $("summary").innerHTML = `<b>${groups.length}</b> groups · ` + ["training", "healing", "joining", "starting", "down", "unknown"]
    .filter((s) => counts[s]).map((s) => `<span class="state ${s}">${counts[s]} ${s}</span>`).join(" · ") +
    ` <span class="dim">· click a cell for its group</span>`;
  const shown = groups.find((g) => g.group === selected) || groups.find((g) => g.state === "down") || groups[0];
  const panel = $("selected");
  let card = panel.firstElementChild;
  if (!card) { card = newCard(shown.group); card.id = "selected-card"; panel.appendChild(card); }
  card.querySelector("h3 span").textContent = `group ${shown.group}`;
  fillCard(card, shown);
}

function fillCard(card, g) {
  card.dataset.group = g.group;
  card.className = `card ${g.state}`;
  card.dataset.state = g.state;
  const state = card.querySelector(".state");
  state.className = `state ${g.state}`;
  state.textContent = g.state + (g.down_reason ? ` · ${g.down_reason}` : "");
  const badge = card.querySelector(".badge.straggler");
  badge.hidden = !g.straggler;
  if (g.straggler) {
    badge.textContent = `straggler ×${(g.straggler.slowdown ?? 1).toFixed(2)}`;
    badge.title = g.straggler.detail;
  }
  const sdc = card.querySelector(".badge.sdc");
  sdc.hidden = !g.last_sdc || Date.now() / 1000 - g.last_sdc.ts > SDC_BADGE_S;
  if (g.last_sdc) {
    sdc.textContent = `SDC ${g.last_sdc.verdict}`;
    sdc.title = `step ${g.last_sdc.step}: gradient norm ${fmt(g.last_sdc.norm)} against the others' ${fmt(g.last_sdc.reference_norm)}; ` +
      `the step was skipped in every group (${g.last_sdc.action}), ${age(g.last_sdc.ts)} ago`;
  }
  card.querySelector(".step").textContent = g.step ?? "–";
  const heal = g.last_heal ? `last heal: step ${g.last_heal.step} from g${g.last_heal.source_group}, ` +
    `${(g.last_heal.bytes / 2 ** 20).toFixed(0)} MiB in ${g.last_heal.fetch_s.toFixed(2)}s, ${age(g.last_heal.ts)} ago` : "no heal yet";
  const sync = g.last_sync ? `<br>sync ${g.last_sync.outer_step} at step ${g.last_sync.step}` +
    `${g.last_sync.committed ? "" : " (failed)"}: ${g.last_sync.seconds.toFixed(2)}s, ` +
    `${(g.last_sync.bytes / 2 ** 20).toFixed(0)} MiB, drift ${fmt(g.last_sync.drift)}, ${age(g.last_sync.ts)} ago` : "";
  card.querySelector(".meta").innerHTML =
    `loss ${g.diverged ? '<b class="diverged">NaN: diverged</b>' : g.loss?.toFixed(3) ?? "-"} · ${g.participants ?? "-"} groups · quorum ${g.quorum_id ?? "-"} · ${g.state} for ${age(g.since)}<br>${heal}${sync}`;
  const why = card.querySelector(".why");
  why.hidden = !g.down_detail;
  why.textContent = g.down_detail ?? "";
  card.querySelector(".kill").disabled = g.state === "down";
  card.querySelector(".drain").disabled = g.state === "down";
  card.querySelector(".rejoin").disabled = g.state !== "down";
}

async function command(group, action) {
  const result = await api("POST", `/groups/${group}/${action}`);
  if (result) notice(`group ${group}: ${action} sent; now ${result.group_state.state}`, true);
  refresh();
}

// Every stored event of these types since then, oldest first, page after page (at most
// HISTORY_PAGES of them: the newest are the stream's); the newest id read.
const HISTORY_PAGES = 20;
async function loadHistory(types, since) {
  const query = types.map((t) => `type=${t}`).join("&");
  let after = 0;
  for (let pages = 0; pages < HISTORY_PAGES; pages++) {
    const page = await api("GET", `/events?${query}&since=${since}&limit=1000&after_id=${after}`);
    (page?.events || []).forEach(ingest);
    after = page?.events.at(-1)?.id ?? after;
    if (!page?.next_after_id) break;
  }
  return after;
}

// The lines' end labels, each moved down (or up) until it is clear of the ones placed before.
function labelled(ends) {
  const placed = [];
  for (const end of [...ends].sort((a, b) => a.y - b.y)) {
    let y = Math.max(end.y, 12);
    while (placed.some((p) => Math.abs(p.y - y) < 12 && Math.abs(p.x - end.x) < 40)) y += 12;
    if (y > 200) y = Math.max(12, end.y - 12 * placed.filter((p) => Math.abs(p.x - end.x) < 40).length);
    placed.push({ ...end, y });
  }
  return placed.map((p) => `<text x="${p.x}" y="${p.y}" fill="${p.color}">g${p.group}</text>`).join("");
}

function chart(svg, data, fmt) {
  const lines = [...data.entries()].filter(([group, pts]) => pts.length > 1 && charted(group));
  const all = lines.flatMap(([, pts]) => pts);
  if (!all.length) { svg.innerHTML = `<text x="10" y="110">waiting for steps…</text>`; return; }
  const [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  const [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  const sx = (x) => 40 + (560 * (x - x0)) / Math.max(1, x1 - x0);
  const sy = (y) => 205 - (190 * (y - y0)) / Math.max(1e-9, y1 - y0);
  let out = `<line class="axis" x1="40" y1="205" x2="600" y2="205"/><text x="0" y="15">${fmt(y1)}</text>` +
    `<text x="0" y="205">${fmt(y0)}</text><text x="600" y="218" text-anchor="end">step ${x1}</text>`;
  const ends = [];
  for (const [group, pts] of lines) {
    // a gap in steps is time the group was down: the line breaks there
    const d = pts.map((p, i) => `${i && p[0] - pts[i - 1][0] <= 1 ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    const color = COLORS[group % COLORS.length];
    out += `<path d="${d}" fill="none" stroke="${color}" stroke-width="2"/>`;
    ends.push({ group, color, x: Math.round(sx(pts.at(-1)[0]) - 30), y: Math.round(sy(pts.at(-1)[1]) - 6) });
  }
  svg.innerHTML = out + labelled(ends);
}

function charted(group) {
  if (!dense) return true;
  return group === selected || group < CHARTED;
}

function addStep(e) {
  if (e.rank !== 0 || !e.committed || !charted(e.group)) return;
  for (const key of ["loss", "step_s"]) {
    if (e[key] === null) continue;  // a loss that is not finite has no point on the chart
    const pts = series[key].get(e.group) || [];
    if (pts.length && pts.at(-1)[0] >= e.step) pts.length = pts.findIndex((p) => p[0] >= e.step);
    pts.push([e.step, e[key]]);
    if (pts.length > 400) pts.shift();
    series[key].set(e.group, pts);
  }
}

function describe(e) {
  switch (e.type) {
    case "process": return `${e.action}${e.detail ? " (" + e.detail + ")" : ""}`;
    case "heal": return `healed at step ${e.step} from group ${e.source_group}: ${(e.bytes / 2 ** 20).toFixed(1)} MiB in ${e.fetch_s.toFixed(2)}s`;
    case "quorum": return `quorum ${e.quorum_id} with ${e.participants} group(s) at step ${e.step}`;
    case "commit_failed": return `step ${e.step} not committed${e.error ? ": " + e.error.slice(0, 80) : ""}`;
    case "checkpoint": return `checkpoint ${e.action} at step ${e.step} (${e.seconds.toFixed(2)}s)`;
    case "exit": return `exit: ${e.reason} at step ${e.step}`;
    case "straggler": return `straggler ${e.action}: ${e.detail}`;
    case "partition": return `partition: ${e.action}, ${e.detail}`;
    case "sync": return `sync ${e.outer_step} at step ${e.step}: ${e.committed ? "committed" : e.skipped ? "window skipped" : "failed"}` +
      `${e.joined ? " (joined)" : ""}, ${e.participants} groups, ${e.seconds.toFixed(2)}s` + (e.error ? `: ${e.error}` : "");
    case "sdc": return `gradient check at step ${e.step}: norm ${fmt(e.norms[e.group])} against the others' ${fmt(e.reference_norm)}; ` +
      `rerun ${fmt(e.rerun_norm)}, group ${e.checker_group ?? "-"}'s ${fmt(e.checker_norm)}: ${e.verdict}, ${e.action}`;
    default: return e.type;
  }
}

function addTimeline(e) {
  if (!NOTABLE.has(e.type) || (e.rank !== undefined && e.rank !== null && e.rank !== 0)) return;
  if (e.type === "sync" && e.committed && !e.joined) return;  // a sync a window: only joins and failures are news
  const li = document.createElement("li");
  const time = new Date(e.ts * 1000).toLocaleTimeString();
  li.innerHTML = `<span class="t">${time}</span><span class="k ${e.type}">g${e.group} ${e.type}</span>`;
  li.append(describe(e));
  const list = $("events");
  list.prepend(li);
  while (list.children.length > 200) list.lastChild.remove();
}

function ingest(e) {
  if (e.type === "step") addStep(e);
  addTimeline(e);
}

// fault class -> the drill that measures it and its report's "trains again" key (GET /drills/kinds)
let FAULT_CLASSES = [];
const secs = (v) => (v != null ? v.toFixed(2) + "s" : "-");

function byFaultClass(drills) {
  const rows = FAULT_CLASSES.map(({ fault_class: fault, kind, resume_key: resume }) => {
    const last = drills.find((d) => d.kind === kind && d.status === "done");
    return `<tr data-fault="${fault}"><td>${fault}</td><td>${secs(last?.report.detect_s)}</td>` +
      `<td>${secs(last?.report[resume])}</td></tr>`;
  }).join("");
  return `<table class="faults" id="fault-classes"><thead><tr><th>fault</th><th>detected</th>` +
    `<th>trains again</th></tr></thead><tbody>${rows}</tbody></table>`;
}

// A rejoin, phase by phase (the report's "recovery"): one bar, each phase its share of the whole.
function recoveryBar(phases) {
  const counted = (phases || []).filter((p) => !p.within && p.seconds > 0);
  const total = counted.reduce((sum, p) => sum + p.seconds, 0);
  if (!total) return "";
  const parts = counted.map((p, i) => `<span class="phase p${i % 6}" data-phase="${p.phase}" style="width:` +
    `${(100 * p.seconds / total).toFixed(2)}%" title="${p.label} ${secs(p.seconds)}${p.detail ? ": " + p.detail : ""}">` +
    `</span>`).join("");
  const notable = counted.filter((p) => p.seconds >= 0.08 * total).map((p) => `${p.label} ${secs(p.seconds)}`);
  return `<div class="recovery" title="rejoin → healed commit, ${secs(total)}">${parts}</div>` +
    `<div class="dim">${notable.join(" · ")}</div>`;
}

async function renderDrills() {
  const data = await api("GET", "/drills");
  if (!data) return;
  $("drills").innerHTML = byFaultClass(data.drills) + (data.drills.slice(0, 8).map((d) => {
    const r = d.report;
    const detail = d.kind === "chaos"
      ? `goodput ${r.goodput != null ? (100 * r.goodput).toFixed(1) + "%" : "-"} · ${r.kills.length} kills`
      : d.kind === "lighthouse"
      ? `noticed ${secs(r.detect_s)} · away ${secs(r.away_s)} · longest pause ${secs(r.max_pause_s)} · ` +
        `${r.process_exits.length ? `<span class="bad">${r.process_exits.length} process exits</span>` : "no process exits"}`
      : `detect ${r.detect_s?.toFixed(2) ?? "-"}s · resume ${r.survivors_resume_s?.toFixed(2) ?? "-"}s · heal ${r.rejoin_to_healed_commit_s?.toFixed(2) ?? "-"}s · ` +
        (r.fingerprints_equal == null ? "" : r.fingerprints_equal ? `<span class="ok">state equal</span>` : `<span class="bad">STATE DIFFERS</span>`);
    return `<div class="drill">#${d.id} ${d.kind} ${d.group ?? ""} · <b>${d.status}</b> · ${r.phase}<br>${detail}` +
      `${recoveryBar(r.recovery)}</div>`;
  }).join("") || `<div class="dim">none yet</div>`);
}

// The way to --steps: the furthest group's step, tokens/s of the committed steps, the time left.
function renderProgress(groups, d) {
  const bar = $("progress");
  const steps = d?.job?.steps;
  const done = Math.max(...groups.map((g) => g.step ?? -1));
  bar.hidden = !steps || done < 0;
  if (bar.hidden) return;
  const share = Math.min(1, done / steps);
  const stepS = groups.filter((g) => g.state === "training" && g.step_s).map((g) => g.step_s).sort((a, b) => a - b);
  const eta = stepS.length && done < steps ? ` · ETA ${duration((steps - done) * stepS[stepS.length >> 1])}` : "";
  const rate = d.tokens_per_s != null ? ` · ${Math.round(d.tokens_per_s).toLocaleString()} tokens/s` : "";
  bar.innerHTML = `<progress max="${steps}" value="${done}"></progress> step <b>${done.toLocaleString()}</b> of ` +
    `${steps.toLocaleString()} (${(100 * share).toFixed(0)}%)${rate}${eta}`;
}

const duration = (s) => (s < 120 ? `${s.toFixed(0)}s` : s < 7200 ? `${(s / 60).toFixed(0)}m` : `${(s / 3600).toFixed(1)}h`);

function renderData(d) {
  const bar = $("data");
  bar.hidden = !d?.job;
  if (!d?.job) return;
  const j = d.job;
  const epochs = d.epochs == null ? "" : ` · ${d.epochs.toPrecision(3)} epochs`;
  bar.innerHTML = `<b>${esc(j.config)}</b> (${esc(j.model)}, ${j.dtype}) on <b>${esc(j.dataset)}</b> · ` +
    `batch ${j.global_batch_size} × ${j.seq_len} tokens, ${j.batch_policy} · samples <b>${d.samples_planned.toLocaleString()}</b>${epochs}: ` +
    `<span class="ok">${d.trained_once.toLocaleString()} once</span>, ` +
    `<span class="${d.trained_twice ? "bad" : ""}">${d.trained_twice.toLocaleString()} twice</span>, ` +
    `<span class="${d.skipped ? "warn" : ""}">${d.skipped.toLocaleString()} skipped</span>`;
}

async function refresh() {
  const [q, d] = await Promise.all([api("GET", "/quorum"), api("GET", "/data")]);
  renderData(d);
  if (!q) return;
  renderGroups(q.groups);
  renderProgress(q.groups, d);
  $("quorum").innerHTML = q.lighthouse_reachable
    ? `quorum <b>${q.quorum_id}</b> · members <b>${q.members.length > DENSE_AT ? q.members.length + " groups"
        : q.members.map((m) => "g" + m.group).join(", ") || "none"}</b> · ${q.heartbeating ?? "?"} heartbeating`
    : `<span style="color:var(--red)">Lighthouse unreachable</span>`;
  chart($("loss-chart"), series.loss, (v) => v.toFixed(2));
  chart($("step-chart"), series.step_s, (v) => v.toFixed(2));
}

async function start() {
  // The groups first, from the board alone: the quorum's answer waits on the Lighthouse, which
  // at hundreds of groups is busy forming quorums. Then the quorum and the drills, together; the
  // history below can take a while at hundreds of groups.
  const groups = await api("GET", "/groups");
  if (groups) renderGroups(groups);
  const kinds = await api("GET", "/drills/kinds");
  FAULT_CLASSES = (kinds || []).filter((k) => k.fault_class)
    .sort((a, b) => a.fault_class.localeCompare(b.fault_class));
  await Promise.all([refresh(), renderDrills()]);
  // The stream opens first and holds what it brings while the history loads, so nothing falls
  // between the two: then what the history already had (by event id) is dropped.
  const shown = ["step", ...NOTABLE];  // the charts' steps and the timeline's kinds
  const held = [];
  let seen = null;  // the newest event id of the history, once it is in
  const take = (m) => {
    const e = JSON.parse(m.data);
    if (seen === null) held.push(e); else if (e.id > seen) ingest(e);
  };
  const stream = new EventSource(API + "/events/stream");
  stream.onmessage = take;
  for (const type of shown) stream.addEventListener(type, take);
  seen = await loadHistory(shown, Date.now() / 1000 - 600);
  held.filter((e) => e.id > seen).forEach(ingest);
  $("drill").addEventListener("click", async () => {
    // the last group training (the control plane says why when none can be drilled)
    const cards = [...document.querySelectorAll("#groups > [data-group]")];
    const training = cards.filter((c) => c.dataset.state === "training");
    const group = Number((training.at(-1) ?? cards.at(-1))?.dataset.group ?? 0);
    const drill = await api("POST", "/drills", { kind: "kill-heal", group });
    if (drill) notice(`drill ${drill.id} started on group ${group}`, true);
  });
  setInterval(refresh, 1000);
  setInterval(renderDrills, 3000);
}
start();
