// The minivllm dashboard: draws the records of tracing/trace.py (run, step, request), live from
// /dashboard/stream or replayed from /dashboard/traces. Plain canvas and SVG, no library.
"use strict";

const COLOR = {decode: "#3b7dd8", prefill: "#f0a030", padding: "#b8b8b8", waiting: "#dedede",
               preempted: "#d84040", kv: "#8a5cc2", grid: "#e4e4e4", text: "#555"};
const MAX_ROWS = 40;  // Gantt rows drawn: the newest requests
const ROW_H = 15, LABEL_W = 210;
let WINDOW = 60;  // seconds shown; the server says

// -- one panel: the charts of one engine (live) or one trace (replay) ------------------------------
class Panel {
  constructor(name) {
    this.el = document.getElementById("panel").content.firstElementChild.cloneNode(true);
    this.el.querySelector(".name").textContent = name;
    document.getElementById("panels").append(this.el);
    this.reset();
  }

  reset() {
    this.run = {};
    this.steps = [];
    this.requests = new Map();  // request id -> {n, id, spans: [{state, start, end}], last, end}
    this.finished = [];  // {t, ttft, tpot}
    this.numRequests = 0;
    this.totals = {steps: 0, preempted: 0, finished: 0};
    this.now = 0;
  }

  add(r) {
    if (r.kind === "run") this.run = r;
    else if (r.kind === "step") this.addStep(r);
    else if (r.kind === "request") this.addEvent(r);
  }

  addStep(s) {
    this.steps.push(s);
    this.totals.steps = s.step;
    this.totals.preempted += s.num_preempted;
    this.now = Math.max(this.now, s.t_end);
  }

  addEvent(e) {
    let q = this.requests.get(e.request_id);
    if (!q) {
      q = {n: ++this.numRequests, id: e.request_id, spans: [], end: null};
      this.requests.set(e.request_id, q);
    }
    const open = q.spans[q.spans.length - 1];
    if (open && open.end === null) open.end = e.t;
    if (e.state === "finished") {
      q.end = e.t;
      this.totals.finished += 1;
      this.finished.push({t: e.t, ttft: e.ttft, tpot: e.tpot});
    } else {
      q.spans.push({state: e.state, start: e.t, end: null});
    }
    q.last = e;
    this.now = Math.max(this.now, e.t);
  }

  prune(now) {  // keep a minute: the page of a server that runs for days stays small
    const from = now - WINDOW;
    while (this.steps.length && this.steps[0].t_end < from) this.steps.shift();
    while (this.finished.length && this.finished[0].t < from) this.finished.shift();
    for (const [id, q] of this.requests) if (q.end !== null && q.end < from) this.requests.delete(id);
  }

  render(now) {
    this.prune(now);
    const last = this.steps[this.steps.length - 1];
    this.stat("steps", this.totals.steps);
    this.stat("running", last ? last.num_running : 0);
    this.stat("waiting", last ? last.num_waiting : 0);
    this.stat("kv", last ? `${last.num_kv_blocks_used} / ${last.num_kv_blocks_total}` : "-");
    this.stat("kv-total", last ? last.num_kv_blocks_total : "?");
    this.stat("preempted", this.totals.preempted);
    this.stat("finished", this.totals.finished);
    const sum = key => this.steps.reduce((total, s) => total + (s[key] || 0), 0);
    const drafts = sum("num_drafts"), draftTokens = sum("num_draft_tokens"), accepted = sum("num_accepted_tokens");
    this.stat("spec-drafts", drafts);
    this.stat("spec-acceptance", draftTokens ? `${(100 * accepted / draftTokens).toFixed(1)} %` : "-");
    this.stat("spec-length", drafts ? (1 + accepted / drafts).toFixed(2) : "-");
    this.stat("tier-ram", sum("num_tier_ram_tokens"));
    this.stat("tier-disk", sum("num_tier_disk_tokens"));
    const ttft = this.finished.map(f => f.ttft).filter(x => x !== null);
    const tpot = this.finished.map(f => f.tpot).filter(x => x !== null);
    this.stat("ttft-p50", ms(percentile(ttft, 50)));
    this.stat("ttft-p99", ms(percentile(ttft, 99)));
    this.stat("tpot-p50", ms(percentile(tpot, 50)));
    this.stat("tpot-p99", ms(percentile(tpot, 99)));
    this.stat("latency-n", this.finished.length);
    this.drawTokens(now);
    this.drawBatch(now);
    this.drawKV(now);
    this.drawGantt(now);
  }

  stat(name, value) {
    for (const el of this.el.querySelectorAll(`[data-stat="${name}"]`)) el.textContent = value;
  }

  chart(name, now, yMax) {
    const canvas = this.el.querySelector(`[data-chart="${name}"]`);
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== w * ratio || canvas.height !== h * ratio) {
      canvas.width = w * ratio;
      canvas.height = h * ratio;
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const left = 40, bottom = h - 16, top = 6;
    const c = {ctx, w, h, left, bottom, top,
               x: t => left + (t - (now - WINDOW)) / WINDOW * (w - left - 4),
               y: v => bottom - v / yMax * (bottom - top)};
    ctx.font = "10px sans-serif";
    ctx.fillStyle = COLOR.text;
    ctx.strokeStyle = COLOR.grid;
    for (const v of [0, yMax / 2, yMax]) {
      ctx.beginPath(); ctx.moveTo(left, c.y(v)); ctx.lineTo(w, c.y(v)); ctx.stroke();
      ctx.fillText(Math.round(v), 2, c.y(v) + 3);
    }
    for (let s = 0; s < WINDOW; s += WINDOW / 4) ctx.fillText(`-${Math.round(WINDOW - s)}s`, c.x(now - WINDOW + s) - 10, h - 3);
    ctx.fillText("now", w - 22, h - 3);
    return c;
  }

  drawTokens(now) {
    const budget = this.run.scheduler === "continuous" ? this.run.max_num_batched_tokens : 0;
    const peak = Math.max(1, ...this.steps.map(s => s.num_scheduled_tokens));
    const c = this.chart("tokens", now, niceMax(budget && budget < 4 * peak ? Math.max(peak, budget) : peak));
    for (const s of this.steps) {
      const x0 = c.x(s.t_start), width = Math.max(1, c.x(s.t_end) - x0);
      let v = 0;
      for (const [key, n] of [["decode", s.num_decode_tokens], ["prefill", s.num_prefill_tokens],
                              ["padding", s.num_padding_tokens]]) {
        c.ctx.fillStyle = COLOR[key];
        c.ctx.fillRect(x0, c.y(v + n), width, c.y(v) - c.y(v + n));
        v += n;
      }
    }
    if (budget && c.y(budget) >= c.top) dashed(c, budget);
  }

  drawBatch(now) {
    const peak = Math.max(1, ...this.steps.map(s => Math.max(s.num_running, s.num_waiting)));
    const c = this.chart("batch", now, niceMax(peak));
    stairs(c, this.steps, s => s.num_running, COLOR.decode);
    stairs(c, this.steps, s => s.num_waiting, COLOR.preempted);
  }

  drawKV(now) {
    const total = this.steps.length ? this.steps[this.steps.length - 1].num_kv_blocks_total : 1;
    const c = this.chart("kv", now, total);
    c.ctx.fillStyle = COLOR.kv;
    for (const s of this.steps) {
      const x0 = c.x(s.t_start);
      c.ctx.fillRect(x0, c.y(s.num_kv_blocks_used), Math.max(1, c.x(s.t_end) - x0), c.y(0) - c.y(s.num_kv_blocks_used));
    }
    c.ctx.fillStyle = COLOR.preempted;
    for (const s of this.steps.filter(s => s.num_preempted > 0)) c.ctx.fillRect(c.x(s.t_start) - 1, c.top, 3, 10);
  }

  drawGantt(now) {
    const svg = this.el.querySelector('[data-chart="gantt"]');
    const rows = [...this.requests.values()].slice(-MAX_ROWS);
    const w = svg.clientWidth || 800, h = rows.length * ROW_H + 16;
    const x = t => LABEL_W + Math.max(0, (t - (now - WINDOW)) / WINDOW) * (w - LABEL_W - 4);
    svg.setAttribute("height", h);
    const axis = [0, 1, 2, 3].map(k => el("text", {x: x(now - WINDOW + k * WINDOW / 4) - 10, y: h - 2},
                                         `-${Math.round(WINDOW - k * WINDOW / 4)}s`));
    axis.push(el("text", {x: w - 4, y: h - 2, "text-anchor": "end"}, "now"));
    svg.replaceChildren(...axis, ...rows.map((q, i) => {
      const g = el("g", {class: "request", "data-id": q.id, "data-state": q.end !== null ? "finished" : q.last.state,
                         transform: `translate(0, ${i * ROW_H + 2})`});
      g.append(el("title", {}, q.id));
      g.append(el("text", {x: 2, y: ROW_H - 4}, `#${q.n} ${label(q)}`));
      for (const s of q.spans) {
        const end = s.end === null ? now : s.end;
        if (end < now - WINDOW) continue;
        g.append(el("rect", {x: x(s.start), y: 1, width: Math.max(1, x(end) - x(s.start)), height: ROW_H - 3,
                             fill: COLOR[s.state]}));
      }
      if (q.end !== null) g.append(el("rect", {x: x(q.end) - 1, y: 0, width: 2, height: ROW_H - 1, fill: "#333"}));
      return g;
    }));
  }
}

// -- drawing helpers ------------------------------------------------------------------------------------
function el(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function label(q) {
  const e = q.last;
  if (q.end !== null) return `finished (${e.finish_reason})`;
  if (e.state === "prefill") return `prefilling ${e.num_computed_tokens}/${e.prefill_len}`;
  if (e.state === "decode") return "decoding";
  return e.state;
}

function stairs(c, steps, value, color) {
  c.ctx.strokeStyle = color;
  c.ctx.lineWidth = 1.5;
  c.ctx.beginPath();
  steps.forEach((s, i) => {  // a value holds from its step's end to the next step's start
    const y = c.y(value(s));
    if (i === 0) c.ctx.moveTo(c.x(s.t_start), y); else c.ctx.lineTo(c.x(s.t_start), c.y(value(steps[i - 1])));
    c.ctx.lineTo(c.x(s.t_start), y);
    c.ctx.lineTo(c.x(s.t_end), y);
  });
  c.ctx.stroke();
  c.ctx.lineWidth = 1;
}

function dashed(c, v) {
  c.ctx.strokeStyle = "#444";
  c.ctx.setLineDash([4, 3]);
  c.ctx.beginPath(); c.ctx.moveTo(c.left, c.y(v)); c.ctx.lineTo(c.w, c.y(v)); c.ctx.stroke();
  c.ctx.setLineDash([]);
}

function niceMax(v) {  // 1, 2 or 5 times a power of ten, at least v
  const p = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map(m => m * p).find(m => m >= v);
}

function percentile(xs, p) {  // nearest rank
  if (!xs.length) return null;
  const sorted = [...xs].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.ceil(p / 100 * sorted.length) - 1)];
}

function ms(seconds) {
  return seconds === null ? "-" : `${(seconds * 1000).toFixed(seconds < 1 ? 1 : 0)} ms`;
}

// -- live: one panel fed by the server's event stream --------------------------------------------------
function live(info) {
  const panel = new Panel(info.title);
  const status = document.getElementById("status");
  let lastSeq = -1, wall = performance.now();
  const source = new EventSource("/dashboard/stream");
  source.onopen = () => { status.textContent = "live"; };
  source.onerror = () => { status.textContent = "disconnected: retrying"; };
  source.onmessage = ev => {
    const {records, missed} = JSON.parse(ev.data);
    if (missed) status.textContent = `live (fell behind: ${missed} records skipped)`;
    for (const r of records) {
      if (r.seq !== undefined) {
        if (r.seq <= lastSeq) continue;  // a reconnect sends the ring again
        lastSeq = r.seq;
      }
      panel.add(r);
    }
    wall = performance.now();
  };
  // Between records the clock runs on, so that an idle server's charts scroll away.
  setInterval(() => panel.render(panel.now + (performance.now() - wall) / 1000), 100);
}

// -- replay: one panel per trace, on one clock that starts at each trace's first record ------------------
function time(r) {
  return r.kind === "step" ? r.t_end : r.kind === "request" ? r.t : -Infinity;
}

async function replay(info) {
  document.getElementById("replay-controls").hidden = false;
  document.getElementById("panels").style.setProperty("--panels", info.traces.length);
  const traces = await (await fetch("/dashboard/traces")).json();
  const runs = traces.map(t => {
    const records = [...t.records].sort((a, b) => time(a) - time(b));
    const times = records.map(time).filter(Number.isFinite);  // sorted
    return {panel: new Panel(t.name), records, start: times[0], next: 0, end: times[times.length - 1] - times[0]};
  });
  const status = document.getElementById("status");
  const speed = document.getElementById("speed");
  let clock = 0, wall = performance.now();
  document.getElementById("restart").onclick = () => {
    clock = 0;
    for (const run of runs) { run.next = 0; run.panel.reset(); }
  };
  setInterval(() => {
    const t = performance.now();
    clock += (t - wall) / 1000 * Number(speed.value);
    wall = t;
    for (const run of runs) {
      while (run.next < run.records.length && time(run.records[run.next]) - run.start <= clock) {
        run.panel.add(run.records[run.next++]);
      }
      run.panel.render(Math.min(clock, run.end) + run.start);
    }
    const end = Math.max(...runs.map(r => r.end));
    status.textContent = `replay: ${Math.min(clock, end).toFixed(1)} s of ${end.toFixed(1)} s`;
  }, 100);
}

(async () => {
  const response = await fetch("/dashboard/info");
  const info = await response.json();
  WINDOW = info.window_s;
  document.getElementById("title").textContent = info.title;
  if (info.mode === "live") live(info); else await replay(info);
})();
