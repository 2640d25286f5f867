// polyrl view: the page over /api/runs, /api/metrics, /api/samples and /files/ (polyrl/view/server.py).
// Plain DOM and SVG; every text from a run goes in through textContent, never as HTML.
"use strict";

const PARAMS = new URLSearchParams(location.search);
const POLL_MS = Math.max(200, Number(PARAMS.get("poll")) || 5000);
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                 "#bcbd22", "#7f7f7f"];
const FIRST = ["reward/mean", "eval/reward_mean", "loss", "policy_loss", "kl", "grad_norm", "lr", "perf/mfu"];
const SVGNS = "http://www.w3.org/2000/svg";

const S = {
  runs: [], evals: [], metrics: {}, metricVersion: {}, samples: null, samplesFor: null, samplesVersion: null,
  selected: new Set(), known: new Set(), focus: null, stepIndex: null, follow: null, refreshes: 0,
};

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

const isNum = (v) => typeof v === "number" && Number.isFinite(v);
const fileUrl = (id, path) => "/files/" + id.split("/").concat(path.split("/")).map(encodeURIComponent).join("/");
const fmt = (v, d = 4) => (isNum(v) ? (Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2) : v.toFixed(d)) : "—");

function duration(s) {
  if (!isNum(s) || s <= 0) return "—";
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.round(s % 60);
  return h ? `${h} h ${m} min` : m ? `${m} min ${sec} s` : `${sec} s`;
}

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

function runColor(id) {
  const i = S.runs.findIndex((r) => r.id === id);
  return PALETTE[(i < 0 ? 0 : i) % PALETTE.length];
}

// ------------------------------------------------------------------------------------------------ refresh
let queue = Promise.resolve();
function refresh() {  // one refresh at a time: a click during a poll waits for it
  queue = queue.then(refreshNow);
  return queue;
}

async function refreshNow() {
  try {
    const data = await getJSON("/api/runs");
    S.runs = data.runs;
    S.evals = data.evals;
    document.getElementById("roots").textContent = data.roots.join(", ");
    for (const r of S.runs) {  // new runs start selected (the page overlays them), up to 8 at first
      if (!S.known.has(r.id)) {
        S.known.add(r.id);
        if (S.selected.size < 8) S.selected.add(r.id);
      }
    }
    const ids = new Set(S.runs.map((r) => r.id));
    for (const id of [...S.selected]) if (!ids.has(id)) S.selected.delete(id);
    await Promise.all(S.runs.filter((r) => S.selected.has(r.id) && S.metricVersion[r.id] !== r.version).map(async (r) => {
      const m = await getJSON("/api/metrics?run=" + encodeURIComponent(r.id));
      S.metrics[r.id] = m.rows;
      S.metricVersion[r.id] = r.version;
    }));
    await loadSamples();
    render();
    document.getElementById("refreshed").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    document.getElementById("refreshed").textContent = "could not refresh: " + e.message;
  }
  S.refreshes += 1;
  document.body.dataset.refreshes = String(S.refreshes);
}

async function poll() {
  await refresh();
  setTimeout(poll, POLL_MS);  // after the refresh: a slow server is never asked twice at once
}

async function loadSamples() {
  const withSamples = S.runs.filter((r) => r.sample_steps.length);
  if (!withSamples.some((r) => r.id === S.focus)) S.focus = withSamples.length ? withSamples[withSamples.length - 1].id : null;
  const run = S.runs.find((r) => r.id === S.focus);
  if (!run) { S.samples = null; S.samplesFor = null; return; }
  if (S.samplesFor === run.id && S.samplesVersion === run.version) return;
  const atEnd = S.samples && S.stepIndex === S.samples.steps.length - 1;
  const data = await getJSON("/api/samples?run=" + encodeURIComponent(run.id));
  if (S.samplesFor !== run.id || atEnd || S.stepIndex === null) S.stepIndex = data.steps.length - 1;
  if (S.samplesFor !== run.id) S.follow = null;
  S.samples = data;
  S.samplesFor = run.id;
  S.samplesVersion = run.version;
}

function render() {
  renderRuns();
  renderCurves();
  renderSamples();
  renderEvals();
}

// ------------------------------------------------------------------------------------------------ runs
function renderRuns() {
  const body = document.querySelector("#runs tbody");
  body.replaceChildren();
  document.getElementById("no-runs").hidden = S.runs.length > 0;
  for (const r of S.runs) {
    const box = el("input", { type: "checkbox", checked: S.selected.has(r.id), title: "overlay this run's curves" });
    box.addEventListener("change", () => {
      if (box.checked) S.selected.add(r.id); else S.selected.delete(r.id);
      refresh();
    });
    const heldout = isNum(r.heldout_last) ? `${fmt(r.heldout_first)} → ${fmt(r.heldout_last)}` : "—";
    const label = el("span", { class: "run-link", title: "show this run's samples", onclick: () => { S.focus = r.id; refresh(); } }, r.label);
    body.append(el("tr", { class: "run", "data-run": r.id },
      el("td", {}, box),
      el("td", {}, el("span", { class: "swatch", "data-color": runColor(r.id) }), label, " ",
        el("a", { href: fileUrl(r.id, "config.yaml"), target: "_blank", class: "note" }, "config")),
      el("td", {}, r.recipe ?? "—"), el("td", {}, r.model ?? "—"), el("td", {}, r.algorithm ?? "—"),
      el("td", { class: "num" }, r.seed ?? "—"),
      el("td", { class: "num steps" }, `${r.step ?? "—"} / ${r.max_steps ?? "?"}`),
      el("td", { class: "state" }, el("span", { class: "state-" + r.state }, r.state),
        r.state_note ? el("div", { class: "note" }, r.state_note) : null,
        r.metrics_note ? el("div", { class: "note" }, r.metrics_note) : null),
      el("td", { class: "num" }, duration(r.wall_seconds)),
      el("td", { class: "num" }, heldout),
      el("td", { class: "alarms" }, r.alarms.length ? el("span", { class: "alarm-text" }, "alarm at step " + r.alarms.join(", ")) : "")));
  }
  for (const sw of body.querySelectorAll(".swatch")) sw.style.background = sw.dataset.color;
}

// ------------------------------------------------------------------------------------------------ curves
// What to draw: each selected run alone, or (band on) the selected runs of one seed group as one mean + band.
function entries() {
  const sel = S.runs.filter((r) => S.selected.has(r.id) && S.metrics[r.id]);
  const band = document.getElementById("band-toggle").checked;
  const out = [], grouped = new Map();
  for (const r of sel) {
    if (band && r.group) {
      if (!grouped.has(r.group)) grouped.set(r.group, []);
      grouped.get(r.group).push(r);
    } else out.push({ kind: "run", runs: [r], id: r.id, color: runColor(r.id), label: r.label });
  }
  for (const [group, runs] of grouped) {
    const seeds = new Set(runs.map((r) => r.seed));
    if (runs.length > 1 && seeds.size === runs.length) {
      out.push({ kind: "band", runs, id: "group:" + group, color: runColor(runs[0].id),
                 label: `${runs[0].recipe ?? runs[0].label}: mean of seeds ${[...seeds].join(", ")}` });
    } else for (const r of runs) out.push({ kind: "run", runs: [r], id: r.id, color: runColor(r.id), label: r.label });
  }
  return out;
}

function seriesKeys(list) {
  const keys = new Set();
  for (const e of list) for (const r of e.runs) for (const row of S.metrics[r.id]) {
    for (const [k, v] of Object.entries(row)) if (k !== "step" && isNum(v)) keys.add(k);
  }
  for (const k of [...keys]) if (/\/ci95_(lo|hi)$/.test(k) || k === "eval/hacking_alarm") keys.delete(k);
  const main = FIRST.filter((k) => keys.has(k));
  const extra = [...keys].filter((k) => k.startsWith("reward_extra/")).sort();
  const evals = [...keys].filter((k) => k.startsWith("eval/") && !FIRST.includes(k)).sort();
  const shown = new Set([...main, ...extra, ...evals]);
  const more = [...keys].filter((k) => !shown.has(k)).sort();
  return { primary: [...main, ...extra, ...evals], more };
}

function points(run, key) {
  return S.metrics[run.id].filter((row) => isNum(row[key])).map((row) => [row.step, row[key]]);
}

// mean and min/max at the steps every run of the group logged
function bandPoints(runs, key) {
  const maps = runs.map((r) => new Map(points(r, key)));
  const steps = [...maps[0].keys()].filter((s) => maps.every((m) => m.has(s))).sort((a, b) => a - b);
  return steps.map((s) => {
    const v = maps.map((m) => m.get(s));
    return [s, v.reduce((a, b) => a + b, 0) / v.length, Math.min(...v), Math.max(...v)];
  });
}

// about n round values between lo and hi, and the decimals that tell them apart
function niceTicks(lo, hi, n) {
  const span = hi - lo, raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((f) => f * mag).find((s) => span / s <= n) || 10 * mag;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
  out.decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  return out;
}

function tickLabel(t, decimals) {
  const a = Math.abs(t);
  return a !== 0 && (a >= 1e5 || a < 1e-3) ? t.toExponential(1) : t.toFixed(Math.min(decimals, 6));
}

function chart(key, list) {
  const W = 330, H = 190, L = 50, R = 10, T = 20, B = 24;
  const drawn = [];
  for (const e of list) {
    if (e.kind === "run") {
      const pts = points(e.runs[0], key);
      let ci = [];
      if (key.startsWith("eval/")) {
        ci = S.metrics[e.id].filter((row) => isNum(row[key + "/ci95_lo"]) && isNum(row[key + "/ci95_hi"]))
          .map((row) => [row.step, row[key], row[key + "/ci95_lo"], row[key + "/ci95_hi"]]);
      }
      if (pts.length) drawn.push({ e, pts, band: ci.length ? ci : null, cls: "ci" });
    } else {
      const b = bandPoints(e.runs, key);
      if (b.length) drawn.push({ e, pts: b.map(([s, m]) => [s, m]), band: b, cls: "band" });
    }
  }
  if (!drawn.length) return null;
  const xs = drawn.flatMap((d) => d.pts.map((p) => p[0]));
  const ys = drawn.flatMap((d) => d.pts.map((p) => p[1]).concat(d.band ? d.band.flatMap((b) => [b[2], b[3]]) : []));
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad;
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const root = svg("svg", { class: "chart", width: W, height: H, viewBox: `0 0 ${W} ${H}`, "data-key": key });
  root.append(svg("text", { class: "title", x: L, y: 13 }, key));
  const yt = niceTicks(y0, y1, 4);
  for (const t of yt) {
    root.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: Y(t), y2: Y(t) }));
    root.append(svg("text", { class: "tick", x: L - 4, y: Y(t) + 3, "text-anchor": "end" }, tickLabel(t, yt.decimals)));
  }
  for (const t of niceTicks(x0, x1, 5).filter((t) => Number.isInteger(t))) {
    root.append(svg("text", { class: "tick", x: X(t), y: H - B + 12, "text-anchor": "middle" }, t));
  }
  root.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  root.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  root.append(svg("text", { class: "tick", x: W - R, y: H - 2, "text-anchor": "end" }, "step"));
  for (const d of drawn) {
    const g = svg("g", { class: "series", "data-run": d.e.id, "data-kind": d.e.kind });
    if (d.band) {
      const top = d.band.map((b) => `${X(b[0])},${Y(b[3])}`), low = d.band.map((b) => `${X(b[0])},${Y(b[2])}`).reverse();
      g.append(svg("path", { class: d.cls, d: `M${top.join("L")}L${low.join("L")}Z`, fill: d.e.color }));
    }
    g.append(svg("polyline", { class: "line", stroke: d.e.color, points: d.pts.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ") }));
    for (const [s, v] of d.pts) {
      g.append(svg("circle", { class: "pt", cx: X(s), cy: Y(v), r: 2.2, fill: d.e.color }, svg("title", {}, `${d.e.label}: step ${s}: ${fmt(v, 5)}`)));
    }
    for (const r of d.e.runs) {
      for (const s of r.alarms) {
        if (s < x0 || s > x1) continue;
        g.append(svg("line", { class: "alarm", x1: X(s), x2: X(s), y1: T, y2: H - B },
          svg("title", {}, `${r.label}: hacking watch alarm at step ${s}`)));
        g.append(svg("text", { class: "alarm-mark", x: X(s) + 2, y: T + 9 }, "!"));
      }
    }
    root.append(g);
  }
  return root;
}

function renderCurves() {
  const list = entries();
  const legend = document.getElementById("legend");
  legend.replaceChildren(...list.map((e) => {
    const sw = el("span", { class: "swatch" });
    sw.style.background = e.color;
    return el("span", { class: "item", "data-kind": e.kind }, sw, e.label + (e.kind === "band" ? " (band: min–max)" : ""));
  }));
  const { primary, more } = seriesKeys(list);
  document.getElementById("charts").replaceChildren(...primary.map((k) => chart(k, list)).filter(Boolean));
  const details = document.getElementById("more-details");
  details.hidden = !more.length;
  document.getElementById("more-charts").replaceChildren(...(details.open ? more.map((k) => chart(k, list)).filter(Boolean) : []));
}

// ------------------------------------------------------------------------------------------------ samples
function renderSamples() {
  const select = document.getElementById("sample-run");
  const withSamples = S.runs.filter((r) => r.sample_steps.length);
  select.replaceChildren(...withSamples.map((r) => el("option", { value: r.id, selected: r.id === S.focus }, r.label)));
  const slider = document.getElementById("step-slider");
  const view = document.getElementById("sample-view");
  const label = document.getElementById("step-label");
  if (!S.samples || !S.samples.steps.length) {
    slider.max = 0; slider.disabled = true; label.textContent = "no held-out samples yet";
    view.replaceChildren(); view.dataset.key = ""; renderFollow(); return;
  }
  const steps = S.samples.steps;
  slider.disabled = false;
  slider.max = String(steps.length - 1);
  S.stepIndex = Math.min(Math.max(S.stepIndex ?? steps.length - 1, 0), steps.length - 1);
  slider.value = String(S.stepIndex);
  const cur = steps[S.stepIndex];
  const rewards = cur.rows.map((r) => r.reward).filter(isNum);
  const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
  label.textContent = `step ${cur.step} (evaluation ${S.stepIndex + 1} of ${steps.length})` +
    (mean !== null ? `: mean held-out reward ${fmt(mean)} over ${rewards.length} samples` : "");
  const files = cur.files;
  const key = JSON.stringify([S.focus, cur.step, files, cur.rows.length]);
  if (view.dataset.key !== key) {  // rebuilt only when it shows something else (no reload on every poll)
    view.dataset.key = key;
    view.replaceChildren(...sampleParts(cur));
  }
  renderFollow();
}

function sampleParts(cur) {
  const parts = [];
  const files = cur.files;
  if (files.mp4) parts.push(el("video", { id: "grid-video", src: fileUrl(S.focus, files.mp4), controls: true, loop: true, muted: true }));
  if (files.wav) parts.push(el("audio", { id: "grid-audio", src: fileUrl(S.focus, files.wav), controls: true }), el("br"));
  if (files.png) parts.push(el("img", { id: "grid-img", src: fileUrl(S.focus, files.png), alt: `held-out samples at step ${cur.step}`, "data-step": cur.step }));
  if (!files.png && !files.mp4 && !files.wav) parts.push(textTable(cur.rows.slice(0, 64)));
  return parts;
}

function textTable(rows) {
  const cols = ["prompt", "response", "reward", "answer", "caption"].filter((c) => rows.some((r) => r[c] !== undefined));
  return el("table", { class: "text-samples" }, el("tr", {}, cols.map((c) => el("th", {}, c))),
    rows.map((r) => el("tr", {}, cols.map((c) => el("td", { class: c === "reward" ? "num" : null }, c === "reward" ? fmt(r[c], 3) : (r[c] ?? ""))))));
}

// the grid's tiles are the same held-out samples at every evaluation (samples/grid.json), so tile i of each step's
// grid is one prompt followed across steps; a text run follows a sample of step_N.jsonl by its place
function renderFollow() {
  const select = document.getElementById("follow");
  const strip = document.getElementById("follow-strip");
  const data = S.samples;
  if (!data || !data.steps.length) { select.replaceChildren(); strip.replaceChildren(); strip.dataset.key = ""; return; }
  const grid = data.grid && Array.isArray(data.grid.tiles) ? data.grid.tiles : null;
  const first = data.steps[0].rows;
  const media = data.steps.some((s) => s.files.png);
  const choices = media && grid ? grid.map((sample, tile) => ({ tile, sample }))
    : first.map((_, sample) => ({ tile: null, sample }));
  if (S.follow === null || S.follow >= choices.length) S.follow = 0;
  select.replaceChildren(...choices.map((c, i) => el("option", { value: i, selected: i === S.follow },
    (c.tile !== null ? `tile ${c.tile + 1}: ` : `#${c.sample + 1}: `) + (first[c.sample]?.prompt ?? "?"))));
  const choice = choices[S.follow];
  const key = JSON.stringify([S.focus, S.samplesVersion, S.follow]);
  if (!choice || strip.dataset.key === key) { if (!choice) strip.replaceChildren(); return; }
  strip.dataset.key = key;
  const figures = data.steps.map((s) => {
    const row = s.rows[choice.sample] || {};
    const caption = el("figcaption", {}, `step ${s.step}: r=${fmt(row.reward, 3)}`);
    if (choice.tile !== null && s.files.png) {
      const canvas = el("canvas", { class: "crop", "data-step": s.step });
      cropTile(canvas, fileUrl(S.focus, s.files.png), choice.tile, grid.length);
      return el("figure", { "data-step": s.step }, canvas, caption);
    }
    return el("figure", { "data-step": s.step }, el("div", { class: "note" }, row.response ?? row.caption ?? ""), caption);
  });
  strip.replaceChildren(...figures);
}

// a grid holds n tiles in min(8, n) columns (trainer/logging.py grid_image), each tile its image and caption
function cropTile(canvas, url, tile, n) {
  const img = new Image();
  img.onload = () => {
    const cols = Math.min(8, n), rows = Math.ceil(n / cols);
    const w = img.naturalWidth / cols, h = img.naturalHeight / rows;
    const scale = Math.min(1, 160 / w);
    canvas.width = Math.round(w * scale);
    canvas.height = Math.round(h * scale);
    canvas.getContext("2d").drawImage(img, (tile % cols) * w, Math.floor(tile / cols) * h, w, h, 0, 0, canvas.width, canvas.height);
    canvas.dataset.loaded = "1";
  };
  img.src = url;
}

// ------------------------------------------------------------------------------------------------ evaluations
function renderEvals() {
  const box = document.getElementById("evals");
  document.getElementById("no-evals").hidden = S.evals.length > 0;
  box.replaceChildren(...S.evals.map(evalBlock));
}

function evalBlock(ev) {
  const rep = ev.report, spec = rep || ev.spec || {};
  const what = spec.checkpoint || spec.model_path || "?";
  const head = el("h3", {}, ev.label);
  const desc = el("div", { class: "what" },
    `${what} on ${spec.data_path ?? "?"}` + (spec.compare_base ? ", paired against its base from the same noise" : ""));
  if (!rep) {
    return el("div", { class: "eval", "data-eval": ev.id }, head, desc,
      el("div", { class: "state-running" }, `in progress: ${ev.done} of ${ev.total ?? "?"} prompts scored`));
  }
  const paired = !!rep.compare_base;
  const cols = ["scorer", "mean", "ci95", ...(paired ? ["base", "delta", "delta ci95", "win rate"] : [])];
  const ci = (c) => (Array.isArray(c) ? `[${fmt(c[0])}, ${fmt(c[1])}]` : "—");
  const sign = (v) => (isNum(v) ? (v > 0 ? "pos" : v < 0 ? "neg" : null) : null);
  const row = (label, s, cls) => el("tr", { class: cls },
    el("td", {}, label), el("td", { class: "num" }, fmt(s.mean)), el("td", { class: "num" }, ci(s.ci95)),
    paired ? [el("td", { class: "num" }, fmt(s.base_mean)),
      el("td", { class: "num " + (sign(s.delta) || "") }, isNum(s.delta) ? (s.delta > 0 ? "+" : "") + fmt(s.delta) : "—"),
      el("td", { class: "num" }, ci(s.delta_ci95)), el("td", { class: "num" }, fmt(s.win_rate, 3))] : []);
  const body = [];
  for (const [name, s] of Object.entries(rep.scorers || {})) {
    body.push(row(name, s, "scorer"));
    for (const [cat, cs] of Object.entries(s.categories || {})) body.push(row(cat, cs, "category"));
    if (isNum(s.category_mean)) {
      body.push(row(`${name}: mean over categories`, { mean: s.category_mean, base_mean: s.base_category_mean, delta: s.category_delta }, "category"));
    }
  }
  const table = el("table", { class: "eval-report" }, el("tr", {}, cols.map((c) => el("th", {}, c))), body);
  const counts = el("div", { class: "what" }, `${rep.prompts} prompts × ${rep.samples_per_prompt} samples, seed ${rep.seed}` +
    (isNum(rep.seconds) ? `, ${duration(rep.seconds)}` : ""));
  const media = ev.media.map((name) => {
    const url = fileUrl(ev.id, name);
    if (name.endsWith(".png")) return el("figure", {}, el("img", { class: "eval-grid", src: url, alt: name }), el("figcaption", {}, name));
    if (name.endsWith(".mp4")) return el("video", { src: url, controls: true, muted: true });
    return el("audio", { src: url, controls: true });
  });
  return el("div", { class: "eval", "data-eval": ev.id }, head, desc, counts, table, media);
}

// ------------------------------------------------------------------------------------------------ controls
document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("step-slider").addEventListener("input", (e) => { S.stepIndex = Number(e.target.value); renderSamples(); });
  document.getElementById("sample-run").addEventListener("change", (e) => { S.focus = e.target.value; refresh(); });
  document.getElementById("follow").addEventListener("change", (e) => { S.follow = Number(e.target.value); renderFollow(); });
  document.getElementById("band-toggle").addEventListener("change", renderCurves);
  document.getElementById("more-details").addEventListener("toggle", renderCurves);
  poll();
});
