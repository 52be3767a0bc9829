// yatt live view: polls /api/run and /api/cluster once a second, asking only for what
// is new, and draws with plain SVG and DOM. Bounded: at most MAX_ROWS steps are kept
// (older ones thinned), at most MAX_EVENTS events of each source.
"use strict";

const MAX_ROWS = 2000;
const MAX_EVENTS = 300;
const POLL_MS = 1000;

const COLORS = ["#2f6fdf", "#e0662b", "#2a9d5b", "#9b4dca", "#c9a400", "#d6336c"];
const CHARTS = [
  { id: "reward", title: "reward", series: [["critic/rewards/mean", "mean reward"]] },
  { id: "accuracy", title: "accuracy", series: [["critic/score/mean", "score (train)"], ["eval/accuracy", "eval accuracy"]] },
  { id: "step-time", title: "step time (s)", series: [["timing_s/step", "measured"], ["placement/predicted_s", "predicted"], ["placement/no_move_s", "predicted without the last move"]] },
  { id: "tokens", title: "tokens/s", series: [["perf/gen_tokens_per_s", "generation"], ["perf/throughput", "step throughput"]] },
  { id: "staleness", title: "staleness (versions)", series: [["async/staleness_mean", "mean"], ["async/staleness_max", "max"]] },
  { id: "logprob-gap", title: "train/rollout log-prob gap", series: [["rollout/logprob_diff_mean", "mean |Δ|"], ["rollout/logprob_diff_max", "max |Δ|"]] },
];
const STAGES = [
  ["gen", "generation", "#2f6fdf"], ["env", "environment", "#6aa2ff"], ["reward", "reward", "#e0662b"],
  ["ref", "reference", "#c9a400"], ["values", "values", "#9b4dca"], ["old_log_prob", "old log-probs", "#7a8799"],
  ["adv", "advantages", "#b0b8c4"], ["update_actor", "train (policy)", "#2a9d5b"],
  ["update_critic", "train (critic)", "#7bc89a"], ["weight_sync", "weight sync", "#d6336c"],
  ["offload", "offload", "#555"], ["reload", "reload", "#999"],
];

const st = {
  rows: [], steps: 0, thinned: false, done: 0, total: null, eta: null,
  runSince: 0, runEvents: 0, clusterEvents: 0,
  hasRun: null, hasCluster: null, events: { run: [], cluster: [] }, order: 0,
  plan: null, groups: null, cluster: null, errors: 0,
};

const $ = (id) => document.getElementById(id);
const el = (tag, attrs, text) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
};
const num = (x, d) => (x === null || x === undefined || !isFinite(x)) ? "-" : Number(x).toFixed(d);
const dur = (s) => {
  if (s === null || s === undefined || !isFinite(s)) return "-";
  if (s < 60) return s.toFixed(1) + " s";
  const w = Math.round(s);
  return w < 3600 ? `${Math.floor(w / 60)}m${String(w % 60).padStart(2, "0")}s` : `${Math.floor(w / 3600)}h${String(Math.floor(w % 3600 / 60)).padStart(2, "0")}m`;
};

async function getJson(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (r.status === 404) return null;
  if (!r.ok) throw new Error(`${path}: ${r.status} ${await r.text()}`);
  return r.json();
}

function addEvents(source, list) {
  const into = st.events[source];
  for (const e of list) into.push({ ...e, source, order: ++st.order });
  if (into.length > MAX_EVENTS) into.splice(0, into.length - MAX_EVENTS);
}

function addRows(rows) {
  for (const r of rows) st.rows.push(r);
  st.steps += rows.length;
  if (st.rows.length > MAX_ROWS) {
    // Thin the older part to every other row; the last 500 stay whole.
    const keep = 500, old = st.rows.slice(0, st.rows.length - keep);
    st.rows = old.filter((_, i) => i % 2 === 0).concat(st.rows.slice(st.rows.length - keep));
    st.thinned = true;
  }
}

async function pollRun() {
  if (st.hasRun === false) return false;
  const a = await getJson(`/api/run?since=${st.runSince}&events_since=${st.runEvents}`);
  if (a === null) { st.hasRun = false; return false; }
  st.hasRun = true;
  if (a.done < st.runSince) { st.rows = []; st.steps = 0; } // the file was rewritten
  addRows(a.steps);
  if (a.steps.length) st.runSince = a.steps[a.steps.length - 1].step;
  addEvents("run", a.events);
  if (a.events.length) st.runEvents = a.events[a.events.length - 1].seq;
  Object.assign(st, { done: a.done, total: a.total, eta: a.eta_s, plan: a.plan, groups: a.groups, dir: a.dir, meanStep: a.mean_step_s });
  return a.more;
}

async function pollCluster() {
  if (st.hasCluster === false) return;
  const c = await getJson(`/api/cluster?events_since=${st.clusterEvents}`);
  if (c === null) { st.hasCluster = false; return; }
  st.hasCluster = true;
  addEvents("cluster", c.events);
  if (c.events.length) st.clusterEvents = c.events[c.events.length - 1].seq;
  st.cluster = c;
}

async function poll() {
  let more = false;
  try {
    more = await pollRun();
    await pollCluster();
    st.errors = 0;
    render();
    $("status").dataset.state = "ok";
    $("status").textContent = "live · updated " + new Date().toLocaleTimeString();
  } catch (e) {
    st.errors += 1;
    $("status").dataset.state = "error";
    $("status").textContent = "cannot reach the server (retrying): " + e.message;
  }
  setTimeout(poll, more ? 0 : POLL_MS * Math.min(1 + st.errors, 10));
}

function last(key) {
  for (let i = st.rows.length - 1; i >= 0; i--) {
    const v = st.rows[i][key];
    if (v !== null && v !== undefined) return v;
  }
  return null;
}

function renderSummary() {
  const s = $("run-summary");
  s.dataset.step = st.done;
  s.dataset.total = st.total === null ? "" : st.total;
  s.dataset.steps = st.steps;
  s.replaceChildren();
  const item = (label, value) => { const d = el("span"); d.append(label + " ", el("b", {}, value)); s.append(d); };
  item("step", `${st.done}${st.total ? " / " + st.total : ""}`);
  item("ETA", st.total && st.done >= st.total ? "done" : dur(st.eta));
  item("mean step", dur(st.meanStep));
  item("reward", num(last("critic/rewards/mean"), 3));
  item("gen tokens/s", num(last("perf/gen_tokens_per_s"), 0));
  item("staleness", num(last("async/staleness_mean"), 2));
  item("log-prob gap", num(last("rollout/logprob_diff_mean"), 4));
  item("weights", "v" + num(last("training/weights_version"), 0));
  $("title").textContent = st.dir || "";
}

function renderChart(def) {
  let fig = $("chart-" + def.id);
  if (!fig) {
    fig = el("figure", { class: "chart", id: "chart-" + def.id, "data-metric": def.series[0][0] });
    fig.append(el("figcaption"), document.createElementNS("http://www.w3.org/2000/svg", "svg"));
    $("charts").append(fig);
  }
  const W = 300, H = 120, P = 4;
  const pts = def.series.map(([key]) => st.rows.filter((r) => r[key] !== null && r[key] !== undefined).map((r) => [r.step, r[key]]));
  const all = pts.flat();
  fig.dataset.points = pts[0].length;
  fig.dataset.steps = st.steps;
  fig.dataset.thinned = st.thinned;
  const cap = fig.querySelector("figcaption");
  cap.replaceChildren(el("b", {}, def.title));
  def.series.forEach(([key, label], i) => {
    if (!pts[i].length) return;
    const k = el("span", { class: "series", "data-key": key, "data-points": pts[i].length });
    k.append(el("span", { class: "key", style: `background:${COLORS[i]}` }), `${label} ${num(pts[i][pts[i].length - 1][1], 3)}`);
    cap.append(k);
  });
  const svg = fig.querySelector("svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.replaceChildren();
  if (!all.length) {
    cap.append(el("span", { class: "muted" }, "not reported by this run"));
    return;
  }
  let [x0, x1, y0, y1] = [Infinity, -Infinity, Infinity, -Infinity];
  for (const [x, y] of all) { x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y); }
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += 0.5; y0 -= 0.5; }
  const sx = (x) => P + (x - x0) / (x1 - x0) * (W - 2 * P);
  const sy = (y) => H - P - (y - y0) / (y1 - y0) * (H - 2 * P);
  pts.forEach((p, i) => {
    if (!p.length) return;
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", p.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", COLORS[i]);
    line.setAttribute("stroke-width", "1.5");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    line.dataset.key = def.series[i][0];
    line.dataset.points = p.length;
    svg.append(line);
  });
  cap.append(el("span", { class: "muted range" }, `steps ${x0}–${x1} · ${num(y0, 3)} to ${num(y1, 3)}${st.thinned ? " · older steps thinned" : ""}`));
  const t = document.createElementNS("http://www.w3.org/2000/svg", "title");
  t.textContent = `${def.title}: steps ${x0}–${x1}, ${num(y0, 3)} to ${num(y1, 3)}`;
  svg.append(t);
}

// The heads a step row has values of (`head/I/timing_s/...`); [null] for a row with the
// means only (one head, or a run written before heads were recorded apart).
function headsOf(r) {
  const heads = new Set();
  for (const k of Object.keys(r)) {
    const m = /^head\/(\d+)\/timing_s\//.exec(k);
    if (m) heads.add(Number(m[1]));
  }
  return heads.size ? [...heads].sort((a, b) => a - b) : [null];
}

// One head's lanes in a step, in seconds from the step's start: the training path (the
// stages of the batch it trains, in order) and, under staleness, the generation of
// later batches that ran beside it. The batch trained was generated in an earlier
// step unless none was carried (the first step), so its generation is in the
// training path only then.
function lanes(r, h) {
  const v = (k) => { const x = h === null ? r[k] : r[`head/${h}/${k}`]; return (x === null || x === undefined || !isFinite(x)) ? 0 : x; };
  const ahead = h === null ? r["async/gen_ahead_s"] : r[`head/${h}/async/gen_ahead_s`];
  const piped = ahead !== null && ahead !== undefined;
  const generatedNow = !piped || !v("async/samples_carried");
  const train = [];
  let x = 0;
  for (const [k, label, color] of STAGES) {
    const d = v("timing_s/" + k);
    if (!d || (!generatedNow && (k === "gen" || k === "env" || k === "reward"))) continue;
    train.push({ k, label, color, x, d });
    x += d;
  }
  const start = generatedNow ? v("timing_s/gen") + v("timing_s/env") + v("timing_s/reward") : 0;
  const gen = piped ? { x: piped && generatedNow ? start : 0, d: v("async/gen_ahead_s") } : null;
  const earlier = piped && !generatedNow ? v("timing_s/gen") + v("timing_s/env") + v("timing_s/reward") : 0;
  return { train, gen, end: x, overlap: v("async/overlap_s"), step: v("timing_s/step"), earlier };
}

function renderTimeline() {
  const box = $("timeline");
  const heads = st.rows.length ? headsOf(st.rows[st.rows.length - 1]) : [null];
  // About 30 rows: 30 steps of one head, fewer steps of several (at least 5).
  const rows = st.rows.slice(-Math.max(5, Math.floor(30 / heads.length)));
  box.dataset.steps = rows.length;
  box.dataset.heads = heads[0] === null ? 0 : heads.length;
  box.replaceChildren();
  const drawn = rows.map((r) => headsOf(r).map((h) => [h, lanes(r, h)]));
  let scale = 0;
  for (const [i, r] of rows.entries()) {
    for (const [, l] of drawn[i]) scale = Math.max(scale, l.end, l.gen ? l.gen.x + l.gen.d : 0, l.step);
    scale = Math.max(scale, r["timing_s/step"] || 0);
  }
  if (!scale) return;
  const pct = (s) => `${s / scale * 100}%`;
  for (const [i, r] of rows.entries()) {
    for (const [h, l] of drawn[i]) {
      const row = el("div", { class: "tl-row", "data-step": r.step, "data-head": h === null ? "" : h });
      const label = h === null ? `step ${r.step}` : `${r.step} · head ${h}`;
      row.append(el("span", { class: "lab", title: h === null ? "the mean over the run's heads" : `step ${r.step}, head ${h}` }, label));
      const bar = el("div", { class: "tl-bar" + (l.gen ? " two" : "") });
      for (const s of l.train) {
        bar.append(el("span", { style: `left:${pct(s.x)};width:${pct(s.d)};background:${s.color}`, title: `${s.label} ${num(s.d, 3)} s`, "data-stage": s.k }));
      }
      if (l.gen) {
        const title = `generation of later batches ${num(l.gen.d, 3)} s, beside training for ${num(l.overlap, 3)} s` + (l.earlier ? `; this step's batch was generated in an earlier step (${num(l.earlier, 3)} s)` : "");
        bar.append(el("span", { class: "ahead", style: `left:${pct(l.gen.x)};width:${pct(l.gen.d)}`, title, "data-stage": "gen_ahead", "data-seconds": num(l.gen.d, 4) }));
        if (l.overlap > 0) {
          bar.append(el("b", { class: "overlap", style: `left:${pct(l.gen.x)};width:${pct(l.overlap)}`, title: `generation and training overlapped for ${num(l.overlap, 3)} s`, "data-overlap-s": num(l.overlap, 4) }));
        }
      }
      if (l.step) bar.append(el("i", { style: `left:${pct(l.step)}`, title: `step ${num(l.step, 3)} s wall; overlap ${num(l.overlap, 3)} s` }));
      row.append(bar);
      box.append(row);
    }
  }
  const legend = $("legend");
  if (!legend.childElementCount) {
    for (const [k, label, color] of STAGES.concat([["gen_ahead", "generation of later batches (staleness)", "#2f6fdf"]])) {
      const s = el("span");
      s.append(el("span", { class: "key" + (k === "gen_ahead" ? " ahead" : ""), style: `background:${color};height:8px` }), label);
      legend.append(s);
    }
  }
}

function renderPlan() {
  if (!st.plan) return;
  const box = $("plan");
  box.replaceChildren();
  const p = st.plan;
  box.append(el("div", {}, `plan in force since step ${p.step} · routing v${p.routing_version} · directory epoch ${p.directory_epoch}`));
  for (const pool of p.pools) {
    const d = el("div", { class: "pool", "data-roles": pool.roles });
    d.textContent = `${pool.roles}: ${pool.groups.join(" ")}`;
    box.append(d);
  }
  const g = $("groups");
  g.replaceChildren();
  if (Array.isArray(st.groups) && st.groups.length) {
    g.append(el("h3", {}, "group busy time, last step"));
    const max = Math.max(...st.groups.map((x) => x.busy_s), 1e-9);
    for (const x of st.groups) {
      const row = el("div", { class: "tl-row" });
      row.append(el("span", { class: "lab" }, `${x.group} ${x.roles}`));
      const bar = el("div", { class: "tl-bar" });
      bar.append(el("span", { style: `left:0;width:${x.busy_s / max * 100}%;background:${x.roles.includes("rollout") ? "#2f6fdf" : "#2a9d5b"}`, title: `${num(x.busy_s, 3)} s` }));
      row.append(bar);
      g.append(row);
    }
  }
}

// The roles that hold a device, in whichever process they run ("rollout ×2, policy").
function heldBy(d) {
  const n = {};
  for (const r of d.held_by || []) n[r] = (n[r] || 0) + 1;
  return Object.entries(n).map(([r, k]) => k > 1 ? `${r} ×${k}` : r).join(", ");
}

// Which plan group holds each device, when the run's plan says where its groups are.
function holders() {
  const out = {};
  if (!st.plan || !st.plan.places) return out;
  const roles = {};
  for (const pool of st.plan.pools) for (const g of pool.groups) roles[g] = pool.roles;
  for (const pl of st.plan.places) for (const d of pl.devices) out[`${pl.node}/${d}`] = `${pl.group} ${roles[pl.group] || "idle"}`;
  return out;
}

function renderCluster() {
  const c = st.cluster;
  if (!c) return;
  const s = $("cluster-summary");
  s.replaceChildren();
  s.dataset.leader = c.leader;
  s.dataset.term = c.term;
  const item = (label, value) => { const d = el("span"); d.append(label + " ", el("b", {}, String(value))); s.append(d); };
  item("this node", c.node);
  item("leader", c.leader);
  item("term", c.term);
  item("directory epoch", c.epoch);
  item("nodes alive", `${c.nodes.filter((n) => n.alive).length} / ${c.nodes.length}`);
  const held = holders();
  const body = $("nodes").querySelector("tbody");
  body.replaceChildren();
  for (const n of c.nodes) {
    const tr = el("tr", { class: "node", "data-node": n.name, "data-alive": n.alive, "data-kind": n.kind, "data-incarnation": n.incarnation });
    tr.append(el("td", { class: n.name === c.leader ? "leader" : "" }, n.name));
    tr.append(el("td", {}, String(n.incarnation)));
    tr.append(el("td", {}, n.kind));
    tr.append(el("td", {}, n.alive ? "alive" : "dead: " + (n.dead_because || "")));
    const dev = el("td");
    if (!n.devices.length) dev.append(el("span", { class: "muted" }, "none"));
    for (const d of n.devices) {
      // The plan's group where a live placement placed one; else the roles running on it.
      const h = (d.kind !== "cpu" && held[`${n.name}/${d.index}`]) || heldBy(d);
      const name = d.kind === "cpu" ? "cpu" : `${d.kind}:${d.index}`;
      dev.append(el("span", { class: "device", "data-index": d.index, "data-kind": d.kind, "data-holder": h || "" }, `${name}${h ? " (" + h + ")" : ""}`));
    }
    tr.append(dev);
    const act = el("td");
    const alive = n.actors.filter((a) => a.alive), dead = n.actors.filter((a) => !a.alive).slice(-8);
    for (const a of alive.concat(dead)) act.append(el("span", { class: "actor", "data-role": a.role, "data-alive": a.alive, title: a.id }, a.id));
    tr.append(act);
    body.append(tr);
  }
}

function renderEvents() {
  const all = st.events.run.concat(st.events.cluster).sort((a, b) => (b.unix_ms - a.unix_ms) || (b.order - a.order));
  const ol = $("events");
  ol.dataset.count = all.length;
  ol.replaceChildren();
  for (const e of all) {
    const li = el("li", { class: "event", "data-kind": e.kind, "data-source": e.source });
    const when = e.source === "run" ? `step ${e.step}` : new Date(e.unix_ms).toLocaleTimeString();
    li.append(el("span", { class: "tag" }, e.kind.replace("_", " ")), ` ${when} · ${e.text}`);
    ol.append(li);
  }
}

let rendered = -1;
function render() {
  $("run-view").hidden = !st.hasRun;
  $("cluster-view").hidden = !st.hasCluster;
  if (st.hasRun) {
    renderSummary();
    if (rendered !== st.steps) {
      for (const def of CHARTS) renderChart(def);
      renderTimeline();
      rendered = st.steps;
    }
    renderPlan();
  }
  renderCluster();
  renderEvents();
  document.body.dataset.ready = "true";
}

poll();
