// The llmgw fleet page: polls /fleet/state and redraws. Read-only.
// Every string from the bucket is set with textContent or as an attribute value, never as
// markup: node names, model names and explanations are outside input.
"use strict";

const GB = 1e9;
let skew = 0; // browser clock minus the router's, in seconds
let pollS = 2;
let lastOk = 0;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") e.className = v;
    else e.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

const gb = (b) => (b === null || b === undefined ? "?" : (b / GB).toFixed(1) + " GB");
const secs = (s) => (s === null || s === undefined ? "–" : s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s");

function age(seconds) {
  if (seconds < 120) return Math.max(0, Math.round(seconds)) + "s ago";
  if (seconds < 7200) return Math.round(seconds / 60) + "m ago";
  return (seconds / 3600).toFixed(1) + "h ago";
}

function phase(p) {
  return el("span", { class: "badge phase-" + p, "data-role": "phase" }, p);
}

function routerNow() {
  return Date.now() / 1000 - skew;
}

// --- models ------------------------------------------------------------------------------

function loadCell(load, fleet, routers) {
  const t = load.ttfb;
  const queued = load.queued === null ? "–" : load.queued;
  const since = t && t.window_s ? `in ${Math.round(t.window_s / 60)} min` : "since the router started";
  const ttfb = t && t.count
    ? `p50 ${secs(t.p50_s)} · p95 ${secs(t.p95_s)} (${t.count} ${since})`
    : "no requests " + (t ? since : "yet");
  const all = fleet
    ? el("div", { "data-role": "fleet-load" },
      `all ${routers} router${routers === 1 ? "" : "s"}: in flight ${fleet.in_flight} · ` +
      `queued ${fleet.queued} · slowest first token ${secs(fleet.ttft_ms / 1000)}`)
    : null;
  const share = load.share === null || load.share === undefined ? "" : ` of ${load.share}`;
  return el("td", { "data-role": "load" },
    el("div", {}, `in flight ${load.in_flight}${share} · queued ${queued}`),
    el("div", { class: "muted" }, "first token " + ttfb),
    queueList(load.queue || []),
    all);
}

// the router's queue by class and team: who waits now, and how long they waited
function queueList(queue) {
  if (!queue.length) return null;
  const ul = el("ul", { class: "refused", "data-role": "queue" });
  for (const q of queue) {
    const w = q.wait;
    const waited = w && w.count
      ? `waited p50 ${secs(w.p50_s)} · p95 ${secs(w.p95_s)} (${w.count})`
      : "none waited";
    ul.append(el("li", { "data-class": q.class, "data-team": q.team },
      `${q.class} · ${q.team || "no team"}: ${q.waiting} waiting · `,
      el("span", { class: "muted" }, waited)));
  }
  return ul;
}

// what the engine's own /metrics said, as `llmgw status` says it (cli/status.py load_line)
function engineLoad(e) {
  const pct = (x) => `${Math.round(x * 100)}%`;
  const parts = [];
  if (e.running !== null) parts.push(`${e.running} running`);
  if (e.waiting !== null) parts.push(`${e.waiting} waiting`);
  if (e.kv_cache !== null) parts.push("KV cache " + pct(e.kv_cache));
  if (e.prefix_hits !== null) parts.push("prefix cache hits " + pct(e.prefix_hits));
  return parts.join(", ") || "no load reported";
}

function replicaList(m) {
  if (!m.replicas.length) return el("td", { class: "muted" }, "none");
  const ul = el("ul", { class: "refused" });
  for (const r of m.replicas) {
    // the node's phase beside the replica's: "ready, node a unreachable for 20 s"
    const nodeNote = r.state !== r.phase ? r.state.slice(r.phase.length + 2) : "";
    const li = el("li", { "data-replica": r.rid, "data-serving": String(r.serving) },
      phase(r.phase), " ", r.rid, " on ", r.nodes.join(", "),
      nodeNote ? el("span", { class: "why", "data-role": "node-phase" }, " (" + nodeNote + ")") : null,
      r.endpoint ? el("span", { class: "muted" }, " → " + r.endpoint) : null,
      r.shards.length ? el("span", { class: "muted" }, " shards " + r.shards.map((s) => s.phase).join("/")) : null);
    if (r.failure) {
      li.append(el("div", { class: "why", "data-role": "failure" }, "failed: " + r.failure));
      for (const s of r.shards) {
        const tail = s.output_tail.filter((line) => line.trim());
        if (s.phase === "failed" && tail.length) {
          li.append(el("pre", { class: "tail" }, tail.slice(-3).join("\n")));
        }
      }
    }
    for (const s of r.shards.filter((s) => s.phase === "validating" && s.reason)) {
      // an expected wait before launch ("waiting: GPU ... has 10.0 GB free ..."): no failure
      li.append(el("div", { class: "muted", "data-role": "waiting" }, `${s.node}: ${s.reason}`));
    }
    if (r.why) li.append(el("div", { class: "muted" }, "why: " + r.why));
    if (r.load) li.append(el("div", { class: "muted", "data-role": "engine-load" }, "engine: " + engineLoad(r.load)));
    for (const s of r.shards.filter((s) => s.gpu_outgrown)) {
      li.append(el("div", { class: "why", "data-role": "outgrown" },
        `${s.node}: engine outgrew its GPU allotment: holds ${gb(s.gpu_used_bytes)}, given ${gb(s.gpu_allotted_bytes)}; not stopped`));
    }
    ul.append(li);
  }
  return el("td", {}, ul);
}

function whyCell(m) {
  const p = m.placement;
  if (m.why_not && (!p || !p.unplaced)) return el("td", { "data-role": "why" }, el("div", { class: "why" }, m.why_not));
  if (!p || (!p.unplaced && !p.explanation)) return el("td", { class: "muted" }, "");
  const td = el("td", { "data-role": "why" });
  if (p.unplaced) td.append(el("div", { class: "why" }, `${p.unplaced} unplaced: `, p.explanation || p.blocked || "waiting for a pass"));
  else td.append(el("div", { class: "muted" }, p.explanation));
  if (p.unplaced && p.refused.length) {
    const ul = el("ul", { class: "refused" });
    for (const x of p.refused) {
      ul.append(el("li", {}, `${x.nodes} of ${p.judged}: ${x.reason}`,
        x.detail ? ` (${x.detail})` : "", el("span", { class: "muted" }, ` · profile ${x.profile}`)));
    }
    td.append(ul);
  }
  return td;
}

function models(state) {
  const box = document.getElementById("models");
  if (!state.models.length) {
    box.replaceChildren(el("p", { class: "muted" }, "No models yet: llmgw catalog apply FILE, then llmgw place MODEL."));
    return;
  }
  const table = el("table", {},
    el("tr", {}, ...["model", "replicas", "requests (this router)", "where", "why not ready"].map((h) => el("th", {}, h))));
  for (const m of state.models) {
    const ready = m.ready;
    table.append(el("tr", { "data-model": m.id },
      el("td", {}, el("div", { class: "node-id" }, m.id),
        m.served_name && m.served_name !== m.id ? el("div", { class: "muted" }, "served as " + m.served_name) : null),
      el("td", {}, `${ready}/${m.desired} ready`),
      loadCell(m.load, m.fleet_load, state.load.routers),
      replicaList(m),
      whyCell(m)));
  }
  const parts = [table];
  if (state.unreadable.length) {
    const ul = el("ul", { class: "refused" });
    for (const u of state.unreadable) {
      ul.append(el("li", { "data-unreadable": u.key }, `${u.key} (revision ${u.revision}): ${u.why}`,
        el("span", { class: "muted" }, " · read as " + u.reading)));
    }
    parts.push(el("div", { class: "why" }, "values that do not read (every reader takes them the same way):", ul));
  }
  box.replaceChildren(...parts);
  document.getElementById("load-scope").textContent =
    "Requests in flight, queued and time to first token are " + state.load.scope +
    "'s; the line under them sums every router's published load (load.<router> keys).";
}

// --- nodes -------------------------------------------------------------------------------

function gpuName(g) {
  // a MIG device is a GPU of its own: its profile, its card's index and the card named
  if (!g.mig_profile) return el("b", {}, `GPU ${g.index} `);
  const slices = g.mig_slices ? `, ${g.mig_slices} slice${g.mig_slices === 1 ? "" : "s"}` : "";
  return el("span", { "data-role": "mig" }, el("b", {}, `MIG ${g.mig_profile} of GPU ${g.index} `),
    el("span", { class: "muted" }, `(parent ${g.parent_uuid || "?"}${slices}) `));
}

function left(b) {
  // what one more shared replica could be given (llmgw.allotment.room, placement's rule)
  if (b === null || b === undefined) return "none (out of service)";
  return b < 0 ? `none (${gb(-b)} over)` : gb(b);
}

function sharedList(g) {
  const ul = el("ul", { class: "shared" });
  for (const a of g.shared) {
    const held = a.used_bytes === null ? "" : `, holds ${gb(a.used_bytes)}`;
    ul.append(el("li", { "data-replica": a.replica, "data-outgrown": a.outgrown ? "1" : null },
      `${a.model} ${a.replica}: ${gb(a.bytes)} allotted${held}`,
      a.outgrown ? el("span", { class: "why" }, " · outgrew its allotment by more than the margin; not stopped") : null));
  }
  return ul;
}

function alike(g) {
  // what a GPU's row says but its index: GPUs with the same are drawn as one row
  const { index, uuid, ...rest } = g;
  return JSON.stringify(rest);
}

function gpuRuns(gpus) {
  // consecutive GPUs that read alike are one row ("GPU 0-7 ... each"), as `llmgw status`
  // prints them: eight idle GPUs are one line, not eight; a shared GPU or a MIG device is
  // always a row of its own
  const runs = [];
  for (const g of gpus) {
    const key = g.mig_profile || g.shared.length ? null : alike(g);
    const last = runs[runs.length - 1];
    if (key !== null && last && last.key === key && last.gpus[last.gpus.length - 1].index === g.index - 1) {
      last.gpus.push(g);
    } else {
      runs.push({ key, gpus: [g] });
    }
  }
  return runs.map((r) => r.gpus);
}

function gpuRow(run) {
  const g = run[0];
  const many = run.length > 1;
  const total = g.total_bytes || 1;
  const bar = el("div", { class: "bar" });
  const own = el("span", { class: "own" });
  own.style.left = "0"; own.style.width = (100 * g.own_bytes / total) + "%";
  const foreign = el("span", { class: "foreign" });
  foreign.style.left = own.style.width; foreign.style.width = (100 * g.foreign_bytes / total) + "%";
  const unaccounted = el("span", { class: "unaccounted" });
  unaccounted.style.left = (100 * (g.own_bytes + g.foreign_bytes) / total) + "%";
  unaccounted.style.width = (100 * g.unaccounted_bytes / total) + "%";
  bar.append(own, foreign, unaccounted);
  let alloc = "free";
  if (g.allocated) {
    const a = el("span", { class: "allocated" });
    a.style.left = "0"; a.style.width = Math.min(100, 100 * g.allocated.bytes / total) + "%";
    bar.append(a);
    alloc = `allocated ${gb(g.allocated.bytes)}${g.allocated.whole ? " (whole GPU)" : ""} to ${g.allocated.model} ${g.allocated.replica}`;
  } else if (g.shared.length) {
    // one outline per allotment, side by side
    let at = 0;
    for (const s of g.shared) {
      const a = el("span", { class: "allocated" });
      a.style.left = Math.min(100, 100 * at / total) + "%";
      a.style.width = Math.min(100, 100 * s.bytes / total) + "%";
      bar.append(a);
      at += s.bytes;
    }
    const n = g.shared.length;
    alloc = el("span", { "data-role": "shared" },
      `shared by ${n} replica${n === 1 ? "" : "s"}, ${gb(g.allotted_bytes)} allotted, left ${left(g.left_bytes)}`);
  }
  if (g.out_of_service) alloc = "out of service";
  const used = (g.used_bytes === null ? "in use: not reported"
    : `in use ${gb(g.used_bytes)} (llmgw ${gb(g.own_bytes)}, others ${gb(g.foreign_bytes)}, unaccounted ${gb(g.unaccounted_bytes)})`)
    + (many ? " each" : "");
  const others = g.processes.filter((p) => !p.own).map((p) => `${p.name || "pid " + p.pid} ${gb(p.used_bytes)}`);
  const name = many ? el("b", {}, `GPU ${g.index}-${run[run.length - 1].index} `) : gpuName(g);
  const attrs = many ? { "data-gpus": `${g.index}-${run[run.length - 1].index}` } : { "data-gpu": g.index, "data-uuid": g.uuid };
  return el("div", { class: "gpu", ...attrs },
    el("div", {}, name, alloc, " · ", used,
      others.length ? el("span", { class: "muted" }, " · others: " + others.join(", ")) : null),
    bar,
    g.shared.length ? sharedList(g) : null);
}

function gpuSummary(n) {
  if (!n.gpus.length) return `none (${n.gpu_status})`;
  const names = {};
  for (const g of n.gpus) names[`${g.name}, ${gb(g.total_bytes)}`] = (names[`${g.name}, ${gb(g.total_bytes)}`] || 0) + 1;
  const kinds = Object.entries(names).map(([name, count]) => `${count}× ${name}`).join("; ");
  const shared = n.gpus.filter((g) => g.shared.length).length;
  return `${n.gpus_free} of ${n.gpus.length} free${shared ? `, ${shared} shared` : ""} · ${kinds}`;
}

function nodeCard(n) {
  const beat = el("span", { class: "age", "data-at": n.heartbeat_at ?? "" },
    n.heartbeat_at ? age(routerNow() - n.heartbeat_at) : "never");
  const kv = el("dl", { class: "kv" },
    el("dt", {}, "heartbeat"), el("dd", {}, beat),
    el("dt", {}, "RAM"), el("dd", {}, `${gb(n.ram_available_bytes)} free of ${gb(n.ram_total_bytes)}`),
    el("dt", {}, "GPUs"), el("dd", {}, gpuSummary(n)),
    el("dt", {}, "engines"), el("dd", {}, n.engines.map((e) => `${e.name} ${e.version || "?"}`).join(", ") || "none"),
    el("dt", {}, "running"), el("dd", {}, n.running.join("; ") || "nothing"));
  if (n.ops && n.ops.state !== "in-service") {
    const what = { cordoned: "cordoned", draining: "draining", "draining-by-force": "draining (--force)" }[n.ops.state];
    kv.append(el("dt", {}, "operator"), el("dd", { "data-role": "ops" }, what + (n.ops.reason ? ": " + n.ops.reason : "")));
  }
  if (n.metrics_error) kv.append(el("dt", {}, "metrics"), el("dd", { class: "why", "data-role": "metrics-error" }, n.metrics_error));
  if (n.phase !== "ready" && n.phase_reason) kv.append(el("dt", {}, "why"), el("dd", {}, n.phase_reason));
  return el("div", { class: "node", "data-node": n.id, "data-phase": n.phase },
    el("div", { class: "node-head" },
      el("span", { class: "node-id" }, n.id), phase(n.phase),
      el("span", { class: "muted" }, `${n.hostname} · ${n.address}`)),
    kv,
    ...gpuRuns(n.gpus).map(gpuRow));
}

function holdings(f) {
  if (!f.holds.length) return el("div", { class: "holds muted" }, "holds no weights the agents reported");
  const ul = el("ul", { class: "refused" });
  for (const h of f.holds) {
    ul.append(el("li", { "data-holds": h.key }, h.key, el("span", { class: "muted" }, " · " +
      h.copies.map((c) => `${c.kind} ${c.store} ${gb(c.bytes)} seen by ${c.nodes.length} node(s)`).join("; "))));
  }
  return el("div", { class: "holds" }, "holds:", ul);
}

function fabrics(state) {
  const box = document.getElementById("fabrics");
  const parts = [];
  if (!state.fabrics.length) parts.push(el("p", { class: "muted" }, "No node has reported yet."));
  for (const f of state.fabrics) {
    parts.push(el("div", { class: "fabric", "data-fabric": f.name },
      el("h3", {}, f.name ? "fabric " + f.name : "on no fabric", el("span", { class: "muted" }, ` · ${f.nodes.length} node(s)`)),
      holdings(f),
      el("div", { class: "nodes" }, ...f.nodes.map(nodeCard))));
  }
  parts.push(el("p", { class: "legend muted" },
    el("span", {}, el("i", { class: "swatch own" }), "memory llmgw's engines use"),
    el("span", {}, el("i", { class: "swatch foreign" }), "memory other processes use"),
    el("span", {}, el("i", { class: "swatch unaccounted" }), "memory in use no listed process accounts for"),
    el("span", {}, el("i", { class: "swatch allocated" }), "memory llmgw allocated")));
  box.replaceChildren(...parts);
}

// --- a client key, where the router shows the fleet only to a client with one ------------

// kept in this tab only (sessionStorage), sent only to this router's /fleet/state
const KEY_ITEM = "llmgw-fleet-key";
let locked = false;

function keyHeaders() {
  const key = sessionStorage.getItem(KEY_ITEM);
  return key ? { authorization: "Bearer " + key } : {};
}

function askForKey(why) {
  locked = true;
  sessionStorage.removeItem(KEY_ITEM);
  document.getElementById("key-why").textContent = why;
  document.getElementById("key-form").hidden = false;
  // what was shown with the access that ended is not left on the screen
  for (const id of ["models", "fabrics", "router", "load-scope"]) document.getElementById(id).replaceChildren();
  setStatus("locked", "this router shows the fleet only to a client with an API key");
}

document.getElementById("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = document.getElementById("key");
  sessionStorage.setItem(KEY_ITEM, input.value.trim());
  input.value = "";
  ev.target.hidden = true;
  locked = false;
  poll();
});

// --- polling -----------------------------------------------------------------------------

function setStatus(state, text) {
  const s = document.getElementById("status");
  s.dataset.state = state;
  s.textContent = text;
}

function render(state) {
  skew = Date.now() / 1000 - state.now;
  pollS = state.router.poll_s || pollS;
  const r = state.router;
  document.getElementById("router").textContent =
    `router: ${r.source}${r.nats ? ", NATS " + r.nats : ""} · ${r.models_ready}/${r.models} model(s) served`;
  models(state);
  fabrics(state);
  document.body.dataset.rendered = String((Number(document.body.dataset.rendered) || 0) + 1);
}

async function poll() {
  try {
    const resp = await fetch("/fleet/state", { cache: "no-store", headers: keyHeaders() });
    if (resp.status === 401) {
      // polled again once a key is given: every refusal is a line in the audit trail
      const body = await resp.json().catch(() => ({}));
      askForKey((body.error && body.error.message) || "a client API key is needed");
      return;
    }
    if (!resp.ok) throw new Error("answered " + resp.status);
    const state = await resp.json();
    render(state);
    lastOk = Date.now();
    if (state.router.fleet_read === false) setStatus("loading", "reading the fleet…");
    else setStatus("live", "live");
  } catch (e) {
    setStatus(lastOk ? "stale" : "down", `router not answering (${e.message}); retrying`);
  }
  setTimeout(poll, pollS * 1000);
}

function tick() {
  for (const a of document.querySelectorAll(".age[data-at]")) {
    const at = Number(a.dataset.at);
    if (at) a.textContent = age(routerNow() - at);
  }
  if (!locked && lastOk && Date.now() - lastOk > 3 * pollS * 1000) {
    setStatus("stale", `no answer for ${Math.round((Date.now() - lastOk) / 1000)} s; retrying`);
  }
}

poll();
setInterval(tick, 1000);
