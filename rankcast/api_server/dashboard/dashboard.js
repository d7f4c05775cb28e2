// rankcast's dashboard: one page over what every API server already serves.
//
// Sources, all same-origin: /health polled every HEALTH_MS and /metrics every POLL_MS (the
// numbers), /v1/engine_views (each engine as the API server's engine view has it: adapters per
// rank and tier, pins, requests) with every poll and at once after each LoRA event, and the
// engine notification stream /v1/events read live (what each rank did, as it happens). The page
// tracks no engine state from events itself: the residency grid and the expert heat maps render
// the views, the one state every API server, the router and /metrics read. A reload starts from the next poll and
// the stream's ring. No build step and no dependencies, so the page works offline from the
// package.
"use strict";

// How often /metrics is read (the page says so). Rendering the exposition is most of what an
// open page costs the API server: at 2 s it was 1.4 % of its CPU at 32 streams (bench/dashboard.py).
const POLL_MS = 5000;
const HEALTH_MS = 2000; // /health: a few bytes, so an engine going down shows within 2 s
const HISTORY = 60; // samples per sparkline: 5 minutes at POLL_MS
const QUANTILE_WINDOW = 6; // samples (30 s) a TTFT/ITL quantile is computed over
const EVENTS_KEPT = 500; // events held (and shown) by the page
const KEY_STORAGE = "rankcast-api-key";

const page = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  samples: [], // [{t, families}] newest last
  engines: new Map(), // engine -> {state, incarnation, error}
  ranks: new Map(), // engine -> Set(rank), from the weight-load gauges
  views: [], // /v1/engine_views: one view per engine
  viewsFetch: null, // the /v1/engine_views request in flight, if any
  viewsAgain: false, // another fetch is due when it ends (an event arrived meanwhile)
  loadSeconds: new Map(), // adapter -> last seconds a rank took to move it (from the stream)
  lastEventId: null,
  filter: { type: "", key: "" },
  stream: null, // AbortController of the open event stream
};

// ---- fetching ----

function headers() {
  return page.key ? { Authorization: `Bearer ${page.key}` } : {};
}

function noteServer(response) {
  const index = response.headers.get("x-rankcast-api-server");
  if (index !== null) document.getElementById("server").textContent = `API server ${index}`;
}

function needKey() {
  document.getElementById("key-form").hidden = false;
  setStatus("needs the API key");
}

function setStatus(text) {
  document.getElementById("status").textContent = text;
}

// ---- Prometheus text exposition ----

// name{labels} value -> {name: [{labels, value}]}
function parseExposition(text) {
  const families = new Map();
  const line = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/;
  const label = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (const row of text.split("\n")) {
    if (!row || row.startsWith("#")) continue;
    const m = line.exec(row);
    if (!m) continue;
    const labels = {};
    for (const l of (m[3] || "").matchAll(label)) {
      labels[l[1]] = l[2].replace(/\\n/g, "\n").replace(/\\"/g, '"').replace(/\\\\/g, "\\");
    }
    if (!families.has(m[1])) families.set(m[1], []);
    families.get(m[1]).push({ labels, value: Number(m[4]) });
  }
  return families;
}

function series(families, name, where = () => true) {
  return (families.get(name) || []).filter((s) => where(s.labels));
}

function total(families, name, where) {
  return series(families, name, where).reduce((sum, s) => sum + s.value, 0);
}

// A quantile from the growth of a histogram's buckets between two samples (as PromQL's
// histogram_quantile over an increase), linear within the bucket; null without observations.
function quantile(q, newer, older, name) {
  const buckets = new Map();
  for (const s of series(newer, `${name}_bucket`)) {
    buckets.set(s.labels.le, (buckets.get(s.labels.le) || 0) + s.value);
  }
  if (older) {
    for (const s of series(older, `${name}_bucket`)) {
      buckets.set(s.labels.le, (buckets.get(s.labels.le) || 0) - s.value);
    }
  }
  const sorted = [...buckets.entries()]
    .map(([le, count]) => [le === "+Inf" ? Infinity : Number(le), count])
    .sort((a, b) => a[0] - b[0]);
  const count = sorted.length ? sorted[sorted.length - 1][1] : 0;
  if (count <= 0) return null;
  const rank = q * count;
  let lower = 0;
  let below = 0;
  for (const [le, cumulative] of sorted) {
    if (cumulative >= rank) {
      if (le === Infinity) return lower;
      const inBucket = cumulative - below;
      return inBucket > 0 ? lower + ((le - lower) * (rank - below)) / inBucket : le;
    }
    lower = le;
    below = cumulative;
  }
  return lower;
}

// ---- polling ----

async function poll() {
  try {
    const metrics = await fetch("/metrics", { headers: headers() });
    noteServer(metrics);
    const families = parseExposition(await metrics.text());
    page.samples.push({ t: Date.now() / 1000, families });
    if (page.samples.length > HISTORY + 1) page.samples.shift();
    applyMetrics(families);
    await fetchViews();
    setStatus(`updated ${new Date().toLocaleTimeString()}`);
  } catch (error) {
    setStatus(`unreachable (${error.message}); retrying`);
  }
  render();
}

// The engine views, fetched now (or once more after the fetch in flight: an event it may have
// missed arrived), then the grid rendered from them.
async function fetchViews() {
  if (page.viewsFetch) {
    page.viewsAgain = true;
    return page.viewsFetch;
  }
  page.viewsFetch = (async () => {
    do {
      page.viewsAgain = false;
      const response = await fetch("/v1/engine_views", { headers: headers() });
      if (response.ok) page.views = (await response.json()).data || [];
    } while (page.viewsAgain);
  })();
  try {
    await page.viewsFetch;
  } finally {
    page.viewsFetch = null;
  }
  renderResidency();
  renderExperts();
}

async function pollHealth() {
  try {
    const health = await fetch("/health", { headers: headers() });
    applyHealth(health.status, await health.json().catch(() => ({})));
  } catch (error) {
    for (const engine of page.engines.values()) engine.state = "down";
  }
  renderEngines();
}

// /health names every engine core: up, or why not and what the launcher is doing about it.
function applyHealth(status, body) {
  const engines = body.engines || [];
  if (!engines.length) {
    // A server that lists no engines (the Rust API server): one engine, up while it is 200.
    const known = page.engines.get(0) || {};
    page.engines.set(0, { ...known, state: status === 200 ? "up" : "down" });
    return;
  }
  for (const entry of engines) {
    const known = page.engines.get(entry.engine) || {};
    let state = entry.up ? "up" : "down";
    if (!entry.up && entry.supervisor) {
      state = entry.supervisor.state === "given_up" ? "given up" : entry.supervisor.state;
    }
    const incarnation = entry.incarnation ?? known.incarnation ?? 0;
    page.engines.set(entry.engine, { ...known, state, incarnation, error: entry.error || "" });
  }
}

function applyMetrics(families) {
  for (const s of series(families, "rankcast:worker_weights_load_seconds")) {
    const engine = Number(s.labels.engine);
    if (!page.ranks.has(engine)) page.ranks.set(engine, new Set());
    page.ranks.get(engine).add(Number(s.labels.rank));
  }
  for (const s of series(families, "rankcast:engine_up")) {
    const engine = Number(s.labels.engine);
    if (!page.engines.has(engine)) page.engines.set(engine, { state: "up", incarnation: 0 });
  }
}

// ---- the event stream ----

// fetch instead of EventSource: EventSource cannot send the API key. Reconnects resume with
// Last-Event-ID, so a dropped connection loses nothing the server's ring still holds.
async function streamEvents() {
  for (;;) {
    const controller = new AbortController();
    page.stream = controller;
    const params = new URLSearchParams();
    if (page.filter.type) params.set("type", page.filter.type);
    if (page.filter.key) params.set("key", page.filter.key);
    const h = headers();
    const resume = page.lastEventId;
    if (resume) h["Last-Event-ID"] = resume;
    try {
      const response = await fetch(`/v1/events?${params}`, {
        headers: h,
        signal: controller.signal,
      });
      if (response.status === 401) {
        needKey();
        await waitForKey();
        continue;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const server = response.headers.get("x-rankcast-api-server");
      setEventsState(`live from API server ${server}` + (resume ? `, resumed after ${resume}` : ""));
      const state = document.getElementById("events-state");
      state.dataset.server = server ?? "";
      state.dataset.resumedAfter = resume ?? "";
      state.dataset.opened = String(Number(state.dataset.opened || 0) + 1);
      await readEvents(response.body.getReader());
      setEventsState("reconnecting");
    } catch (error) {
      if (controller.signal.aborted) continue; // the filter changed: reopen at once
      setEventsState(`reconnecting (${error.message})`);
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

function setEventsState(text) {
  document.getElementById("events-state").textContent = text;
}

let keyGiven = null;
function waitForKey() {
  return new Promise((resolve) => {
    keyGiven = resolve;
  });
}

async function readEvents(reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      onFrame(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
    }
  }
}

function onFrame(frame) {
  let id = null;
  let name = "message";
  const data = [];
  for (const line of frame.split("\n")) {
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "id") id = value;
    else if (field === "event") name = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return;
  let body;
  try {
    body = JSON.parse(data.join("\n"));
  } catch {
    return;
  }
  if (name !== "message") {
    // The stream's own notices: replay_gap (the ring or a restart lost events), overflow.
    addEvent(noticeItem(name, body));
    return;
  }
  page.lastEventId = id;
  onNotification(id, body);
}

// A replay gap names the range it lost: after the last event the page had, before the first
// one replayed (none: before whatever comes next). The range stands where an event's id does,
// so the hole shows in place among the ids around it, not as one more event.
function noticeItem(name, body) {
  const message = body.message || "";
  if (name !== "replay_gap") return { id: "", type: name, key: "", text: message, gap: true };
  const after = body.last_event_id || "?";
  const before = body.oldest_event_id;
  const range = before ? `${after} … ${before}` : `${after} …`;
  const text = `events missing after ${after}${before ? `, before ${before}` : ""}: ${message}`;
  return { id: range, type: name, key: "", text, gap: true, replayGap: true };
}

function onNotification(id, n) {
  const where = `engine ${n.engine_index} rank ${n.rank}`;
  if (n.type === "notifications_dropped") {
    const who = n.rank < 0 ? `engine ${n.engine_index} core` : where;
    const text = `${n.count} event(s) dropped at ${who} before this point`;
    addEvent({ id, type: n.type, key: "", text, gap: true, ts: n.timestamp });
    return;
  }
  const key = n.key || n.adapter_name || "";
  addEvent({ id, type: n.type, key, text: describe(n, where), ts: n.timestamp });
  if (n.type.startsWith("lora_adapter_")) {
    if (n.seconds !== undefined) page.loadSeconds.set(n.adapter_name, n.seconds);
    fetchViews().catch(() => {}); // the next poll tries again
  }
}

function describe(n, where) {
  switch (n.type) {
    case "lora_adapter_loaded":
      return `${n.adapter_name} read into ${n.tier} in ${ms(n.seconds)} on ${where}`;
    case "lora_adapter_activated":
      return `${n.adapter_name} copied to slot ${n.slot} in ${ms(n.seconds)} on ${where}`;
    case "lora_adapter_evicted":
      return `${n.adapter_name} dropped from ${n.tier} (${n.reason}) on ${where}`;
    case "lora_adapter_pinned":
    case "lora_adapter_unpinned":
      return `${n.adapter_name} on ${where}`;
    case "lora_adapter_load_failed":
      return `${n.adapter_name} failed on ${where}: ${n.error}`;
    case "kv_blocks_stored":
      return `${n.block_hashes.length} block(s)${n.lora_name ? ` of ${n.lora_name}` : ""}`;
    case "kv_blocks_removed":
      return `${n.block_hashes.length} block(s)`;
    case "custom":
      return `${where}: ${JSON.stringify(n.payload)}`;
    default:
      return where;
  }
}

function ms(seconds) {
  return `${(seconds * 1000).toFixed(1)} ms`;
}

// The list itself holds the events shown (the newest EVENTS_KEPT): nothing else reads them.
function addEvent(event) {
  const list = document.getElementById("events");
  list.prepend(eventItem(event));
  while (list.children.length > EVENTS_KEPT) list.lastChild.remove();
}

function eventItem(event) {
  const item = document.createElement("li");
  item.className = event.gap ? "gap" : "event";
  if (event.replayGap) item.classList.add("replay-gap");
  item.dataset.type = event.type;
  if (event.ts !== undefined) item.dataset.ts = String(event.ts); // at the rank, epoch seconds
  const id = document.createElement("span");
  id.className = "id";
  id.textContent = event.id;
  const type = document.createElement("span");
  type.className = "type";
  type.textContent = event.key ? `${event.type} ${event.key}` : event.type;
  const text = document.createElement("span");
  text.textContent = event.text;
  item.append(id, type, text);
  return item;
}

// ---- rendering ----

function render() {
  renderEngines();
  renderSparklines();
  renderResidency();
  renderExperts();
}

function latest() {
  return page.samples[page.samples.length - 1]?.families || new Map();
}

// The sample about `back` polls before the newest (the oldest held when fewer).
function earlier(back) {
  const index = Math.max(0, page.samples.length - 1 - back);
  return page.samples.length > 1 ? page.samples[index] : null;
}

function renderEngines() {
  const body = document.querySelector("#engines tbody");
  const now = latest();
  const minuteAgo = earlier(Math.round(60000 / POLL_MS))?.families;
  const rows = [];
  for (const [engine, info] of [...page.engines.entries()].sort((a, b) => a[0] - b[0])) {
    const mine = (l) => l.engine === String(engine);
    const hits = total(now, "vllm:prefix_cache_hits_total", mine);
    const queries = total(now, "vllm:prefix_cache_queries_total", mine);
    const routed = series(now, "rankcast:routing_decisions_total", mine)
      .map((s) => {
        const before = minuteAgo
          ? total(minuteAgo, "rankcast:routing_decisions_total", (l) =>
              mine(l) && l.reason === s.labels.reason)
          : 0;
        return [s.labels.reason, s.value - before];
      })
      .filter(([, count]) => count > 0)
      .map(([reason, count]) => `${reason} ${count}`)
      .join(", ");
    const expected = total(now, "rankcast:routing_expected_prefix_tokens_total", mine);
    const hit = total(now, "rankcast:routing_hit_prefix_tokens_total", mine);
    const drafted = total(now, "vllm:spec_decode_num_draft_tokens_total", mine);
    const accepted = total(now, "vllm:spec_decode_num_accepted_tokens_total", mine);
    const drafts = total(now, "vllm:spec_decode_num_drafts_total", mine);
    const ranks = page.ranks.get(engine);
    const row = document.createElement("tr");
    row.dataset.engine = engine;
    const cells = [
      ["engine", String(engine)],
      ["state", info.state + (info.error ? `: ${info.error}` : "")],
      ["incarnation", String(info.incarnation ?? 0)],
      ["ranks", ranks ? String(ranks.size) : "?"],
      ["running", String(total(now, "vllm:num_requests_running", mine))],
      ["waiting", String(total(now, "vllm:num_requests_waiting", mine))],
      ["kv", percent(total(now, "vllm:kv_cache_usage_perc", mine))],
      ["hits", queries ? percent(hits / queries) : "-"],
      ["routed", routed || "-"],
      ["accuracy", expected ? percent(hit / expected) : "-"],
      // Of the drafted tokens, those accepted; and tokens per verification (1 + accepted).
      ["drafts", drafted
        ? `${percent(accepted / drafted)} (${(1 + accepted / drafts).toFixed(2)} tok/step)`
        : "-"],
    ];
    for (const [name, text] of cells) {
      const cell = document.createElement("td");
      cell.className = name;
      cell.textContent = text;
      if (name === "state") cell.classList.add(`state-${info.state.replace(" ", "-")}`);
      row.append(cell);
    }
    rows.push(row);
  }
  body.replaceChildren(...rows);
}

function percent(x) {
  return `${(100 * x).toFixed(1)}%`;
}

// Each sparkline: a function of (newer sample, older sample, seconds between) -> value(s).
const SPARKS = [
  ["running / waiting", (n) => [
    total(n, "vllm:num_requests_running"), total(n, "vllm:num_requests_waiting")], ""],
  ["KV cache used", (n) => {
    const usage = series(n, "vllm:kv_cache_usage_perc");
    return [usage.length ? (100 * total(n, "vllm:kv_cache_usage_perc")) / usage.length : 0];
  }, "%"],
  ["prefix hit rate", (n, o) => {
    const q = total(n, "vllm:prefix_cache_queries_total") -
      (o ? total(o, "vllm:prefix_cache_queries_total") : 0);
    const h = total(n, "vllm:prefix_cache_hits_total") -
      (o ? total(o, "vllm:prefix_cache_hits_total") : 0);
    return [q > 0 ? (100 * h) / q : null];
  }, "%"],
  ["tokens/s", (n, o, dt) => [o && dt > 0
    ? (total(n, "vllm:generation_tokens_total") - total(o, "vllm:generation_tokens_total")) / dt
    : null], ""],
  ["TTFT p50 / p99", (n, o) => [
    msOrNull(quantile(0.5, n, o, "vllm:time_to_first_token_seconds")),
    msOrNull(quantile(0.99, n, o, "vllm:time_to_first_token_seconds"))], " ms"],
  ["ITL p50 / p99", (n, o) => [
    msOrNull(quantile(0.5, n, o, "vllm:inter_token_latency_seconds")),
    msOrNull(quantile(0.99, n, o, "vllm:inter_token_latency_seconds"))], " ms"],
];

function msOrNull(seconds) {
  return seconds === null ? null : seconds * 1000;
}

// Rates use the previous poll; quantiles the last QUANTILE_WINDOW polls.
function sparkValues(index, i) {
  const [, compute] = SPARKS[index];
  const newer = page.samples[i];
  const window = index >= 4 ? QUANTILE_WINDOW : 1;
  const older = i - window >= 0 ? page.samples[i - window] : null;
  if (!older && index >= 2) return compute(newer.families, null, 0).map(() => null);
  return compute(newer.families, older?.families, older ? newer.t - older.t : 0);
}

function renderSparklines() {
  const box = document.getElementById("sparklines");
  document.getElementById("poll-note").textContent =
    `(from /metrics every ${POLL_MS / 1000} s, last ${(HISTORY * POLL_MS) / 60000} min)`;
  if (!box.children.length) {
    for (const [label] of SPARKS) {
      const spark = document.createElement("div");
      spark.className = "spark";
      spark.dataset.series = label;
      spark.innerHTML = `<div class="label"><span>${label}</span><span class="value"></span>` +
        `</div><svg viewBox="0 0 ${HISTORY} 36" preserveAspectRatio="none">` +
        `<polyline></polyline><polyline class="second"></polyline></svg>`;
      box.append(spark);
    }
  }
  SPARKS.forEach(([, , unit], index) => {
    const values = page.samples.map((_, i) => sparkValues(index, i));
    const flat = values.flat().filter((v) => v !== null);
    const top = Math.max(1e-9, ...flat);
    const spark = box.children[index];
    const lines = spark.querySelectorAll("polyline");
    lines.forEach((line, k) => {
      const points = values
        .map((v, i) => (v[k] === null || v[k] === undefined ? null :
          `${i + HISTORY - values.length},${(36 - (34 * v[k]) / top).toFixed(1)}`))
        .filter(Boolean);
      line.setAttribute("points", points.join(" "));
    });
    const last = values[values.length - 1] || [];
    spark.querySelector(".value").textContent = last
      .map((v) => (v === null || v === undefined ? "-" : `${v.toFixed(v < 10 ? 1 : 0)}${unit}`))
      .join(" / ");
  });
}

function renderResidency() {
  const grid = residencyGrid(page.views);
  const head = document.querySelector("#lora-grid thead");
  const heading = document.createElement("tr");
  const titles = ["adapter", ...grid.columns.map((c) => `e${c.engine} r${c.rank}`)];
  for (const title of [...titles, "requests", "last move"]) {
    const cell = document.createElement("th");
    cell.textContent = title; // label values are text, never markup
    heading.append(cell);
  }
  head.replaceChildren(heading);
  for (const row of grid.rows) {
    const seconds = document.createElement("td");
    const adapter = row.dataset.adapter;
    seconds.textContent = page.loadSeconds.has(adapter) ? ms(page.loadSeconds.get(adapter)) : "-";
    row.append(seconds);
  }
  document.querySelector("#lora-grid tbody").replaceChildren(...grid.rows);
  document.getElementById("lora-empty").hidden = grid.rows.length > 0;
}

// The grid for the engine views: a column per rank of each engine that serves adapters, a row
// per adapter any of them registered, each cell its tier there ("device" over "cpu"), pinned,
// and partial when that engine's ranks disagree. Only renders: every fact is the view's.
// (tests/dashboard/test_dashboard_view.py renders random views with it and compares.)
function residencyGrid(views) {
  const columns = [];
  const adapters = new Map(); // name -> Map(engine -> the view's adapter entry)
  for (const view of views) {
    if (!view.lora) continue;
    for (let rank = 0; rank < view.lora.world_size; rank++) columns.push({ engine: view.engine, rank });
    for (const adapter of view.lora.adapters) {
      if (!adapters.has(adapter.name)) adapters.set(adapter.name, new Map());
      adapters.get(adapter.name).set(view.engine, adapter);
    }
  }
  const rows = [];
  for (const name of [...adapters.keys()].sort()) {
    const onEngine = adapters.get(name);
    const row = document.createElement("tr");
    row.dataset.adapter = name;
    const title = document.createElement("td");
    title.textContent = name;
    row.append(title);
    let running = 0;
    let waiting = 0;
    for (const entry of onEngine.values()) {
      running += entry.running_requests;
      waiting += entry.waiting_requests;
    }
    for (const { engine, rank } of columns) {
      const cell = document.createElement("td");
      cell.className = "cell";
      cell.dataset.engine = String(engine);
      cell.dataset.rank = String(rank);
      const entry = onEngine.get(engine);
      const here = entry?.ranks.find((r) => r.rank === rank);
      const tiers = here?.tiers || [];
      const tier = tiers.includes("device") ? "device" : tiers.includes("cpu") ? "cpu" : "";
      if (tier) {
        cell.classList.add(`tier-${tier}`);
        cell.textContent = tier === "device" ? "device" : "host";
      }
      if (here?.pinned) cell.classList.add("pinned");
      if (entry?.partial) cell.classList.add("partial");
      cell.dataset.tier = tier;
      row.append(cell);
    }
    const requests = document.createElement("td");
    const flags = [];
    if (running) flags.push("running");
    if (waiting) flags.push("waiting");
    requests.textContent = flags.join(", ") || "-";
    row.append(requests);
    rows.push(row);
  }
  return { columns, rows };
}

function renderExperts() {
  const maps = expertHeatMaps(page.views);
  document.getElementById("expert-maps").replaceChildren(...maps);
  document.getElementById("experts-empty").hidden = maps.length > 0;
}

// A heat map per engine whose view reports expert load: a row per MoE layer, a cell per expert,
// the expert's tokens summed over the engine's ranks (ranks that slice every expert count the
// same tokens, so the share is each rank's; with expert parallelism each counts its own experts,
// so the sum is each expert's tokens once), coloured by its share of the layer's tokens, darkest
// at the largest share on the map. Only renders: every number is the view's.
// (tests/dashboard/test_dashboard_view.py renders random views with it and compares.)
function expertHeatMaps(views) {
  const maps = [];
  for (const view of views) {
    const layers = new Map(); // layer -> tokens per expert, summed over ranks
    for (const row of view.experts || []) {
      const summed = layers.get(row.layer) || [];
      row.tokens.forEach((count, expert) => {
        summed[expert] = (summed[expert] || 0) + count;
      });
      layers.set(row.layer, summed);
    }
    if (!layers.size) continue;
    const width = Math.max(...[...layers.values()].map((tokens) => tokens.length));
    const rows = [...layers.entries()]
      .sort((a, b) => a[0] - b[0])
      .map(([layer, tokens]) => {
        const all = tokens.reduce((sum, count) => sum + (count || 0), 0);
        return [layer, Array.from({ length: width }, (_, e) => tokens[e] || 0), all];
      });
    const top = Math.max(...rows.flatMap(([, tokens, all]) =>
      tokens.map((count) => (all ? count / all : 0))), 1e-9);
    const table = document.createElement("table");
    table.className = "heat";
    table.dataset.engine = String(view.engine);
    const caption = document.createElement("caption");
    caption.textContent = `engine ${view.engine}: ${rows.length} layers x ${width} experts`;
    const heading = document.createElement("tr");
    for (const title of ["layer", ...Array.from({ length: width }, (_, e) => String(e))]) {
      const cell = document.createElement("th");
      cell.textContent = title;
      heading.append(cell);
    }
    const body = rows.map(([layer, tokens, all]) => {
      const tr = document.createElement("tr");
      tr.dataset.layer = String(layer);
      const title = document.createElement("th");
      title.textContent = String(layer);
      tr.append(title);
      tokens.forEach((count, expert) => {
        const share = all ? count / all : 0;
        const cell = document.createElement("td");
        cell.className = "heat-cell";
        cell.dataset.expert = String(expert);
        cell.dataset.tokens = String(count);
        cell.dataset.share = String(share);
        cell.style.backgroundColor = `rgba(198, 40, 40, ${(share / top).toFixed(3)})`;
        cell.title = `layer ${layer}, expert ${expert}: ${count} tokens (${percent(share)})`;
        tr.append(cell);
      });
      return tr;
    });
    table.append(caption, heading, ...body);
    maps.push(table);
  }
  return maps;
}

// ---- start ----

document.getElementById("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  page.key = document.getElementById("api-key").value;
  sessionStorage.setItem(KEY_STORAGE, page.key);
  document.getElementById("key-form").hidden = true;
  if (keyGiven) keyGiven();
});

document.getElementById("event-filter").addEventListener("submit", (e) => {
  e.preventDefault();
  page.filter = {
    type: document.getElementById("filter-type").value.trim(),
    key: document.getElementById("filter-key").value.trim(),
  };
  document.getElementById("events").replaceChildren();
  page.lastEventId = null; // a new filter starts from now, not from the old stream's place
  page.stream?.abort();
});

// Where the server has an API key, the page shows nothing until it has one that works
// (/v1/models answers 401 without it); then it polls and streams with it.
async function start() {
  for (;;) {
    try {
      const response = await fetch("/v1/models", { headers: headers() });
      noteServer(response);
      if (response.status === 401) {
        needKey();
        await waitForKey();
        continue;
      }
      const models = await response.json();
      document.getElementById("model").textContent = models.data?.[0]?.id || "";
      break;
    } catch (error) {
      setStatus(`unreachable (${error.message}); retrying`);
      await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    }
  }
  pollHealth();
  poll();
  setInterval(pollHealth, HEALTH_MS);
  setInterval(poll, POLL_MS);
  streamEvents();
}

start();
