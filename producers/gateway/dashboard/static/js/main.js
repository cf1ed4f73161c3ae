// The operator dashboard: one live stream (/v1/operator/stream) feeds every panel; each control is a REST call,
// confirmed in an in-page dialog, whose result or error shows in the status line.
import { ApiError, call, get, stream, token } from "./api.js";
import { ModelCharts, RING_S } from "./charts.js";
import { RunView } from "./dag.js";
import { confirmAction } from "./dialog.js";
import { el, fmt, setText, syncRows } from "./dom.js";
import { JobLookup, historyQuery, renderRecent } from "./jobs.js";
import { ROLLOUTS_EVERY_MS, RolloutsPanel } from "./rollouts.js";
import { USAGE_EVERY_MS, UsagePanel } from "./usage.js";

const $ = (id) => document.getElementById(id);
const WORKER_STATES = { starting: "warming", ready: "serving", draining: "draining", degraded: "degraded" };
const RECENT_EVERY_MS = 2000;
const RECENT_SHOWN = 25;
const RETRY_MS = [500, 1000, 2000, 4000];
const AUDIT_EVERY_MS = 5000;
const AUDIT_SHOWN = 20;

const state = {
  snapshot: null,
  series: {}, // model -> samples, oldest first, trimmed to the 15-minute ring
  charts: {}, // model -> ModelCharts
  selected: new Set(), // dead letters chosen for redrive / purge
  stream: null, // AbortController of the live stream
  lastEventAt: 0,
  events: 0,
  audit: [], // the newest audit entries, newest first
  auditTimer: null,
  recentTimer: null,
  recent: null, // the latest GET /v1/jobs answer (the job history page shown)
  history: { model: "", state: "", cursor: null }, // its filters, and the cursor of an older page (null: newest)
  rollouts: null, // the latest GET /v1/rollouts answer
  rolloutsTimer: null,
  usageTimer: null,
};
window.fleetDashboard = state; // for the browser tests and for poking at in devtools

// --- access -------------------------------------------------------------------------------------------------

async function start() {
  let access;
  try {
    access = await get("/v1/operator/access");
  } catch (exc) {
    return banner(`Cannot ask the gateway about operator access: ${describe(exc)}`);
  }
  if (!access.enabled) {
    return banner(access.reason || "The operator surface is disabled on this gateway.");
  }
  if (access.token_required && !token.get()) return showLogin();
  $("logout").hidden = !access.token_required;
  connect();
}

function showLogin(message = "") {
  if (state.stream) state.stream.abort();
  clearInterval(state.auditTimer);
  clearInterval(state.recentTimer);
  clearInterval(state.rolloutsTimer);
  clearInterval(state.usageTimer);
  $("main").hidden = true;
  $("login").hidden = false;
  $("logout").hidden = true;
  setText($("login-error"), message);
  live("not logged in", false);
  $("token").focus();
}

function refused(exc) {
  token.clear();
  const why = exc.status === 401 ? "A key or token is needed" : "The key or token was refused";
  showLogin(`${why} (${exc.describe()}). Enter an operator API key or the operator token to log in again.`);
}

function banner(text) {
  const box = $("banner");
  box.textContent = text;
  box.hidden = false;
  live("disabled", false);
}

function describe(exc) {
  return exc instanceof ApiError ? exc.describe() : exc.message;
}

// --- the live stream ----------------------------------------------------------------------------------------

function connect(attempt = 0) {
  if (state.stream) state.stream.abort();
  const controller = new AbortController();
  state.stream = controller;
  $("login").hidden = true;
  $("main").hidden = false;
  live("connecting…", false);
  clearInterval(state.auditTimer);
  refreshAudit();
  state.auditTimer = setInterval(refreshAudit, AUDIT_EVERY_MS);
  clearInterval(state.recentTimer);
  refreshRecent();
  state.recentTimer = setInterval(refreshRecent, RECENT_EVERY_MS);
  clearInterval(state.rolloutsTimer);
  refreshRollouts();
  state.rolloutsTimer = setInterval(refreshRollouts, ROLLOUTS_EVERY_MS);
  clearInterval(state.usageTimer);
  refreshUsage();
  state.usageTimer = setInterval(refreshUsage, USAGE_EVERY_MS);
  let first = true;
  stream("/v1/operator/stream", (name, data) => {
    if (name !== "snapshot") return;
    apply(data, first);
    first = false;
    attempt = 0;
  }, controller.signal)
    .then(() => controller.signal.aborted || retry(controller, attempt, "the live stream ended"))
    .catch((exc) => {
      if (exc.isAuth) return refused(exc);
      retry(controller, attempt, describe(exc));
    });
}

function retry(controller, attempt, why) {
  if (controller.signal.aborted) return;
  live(`reconnecting: ${why}`, false);
  setTimeout(() => controller.signal.aborted || connect(attempt + 1), RETRY_MS[Math.min(attempt, RETRY_MS.length - 1)]);
}

function live(text, ok) {
  const node = $("live");
  setText(node, text);
  node.classList.toggle("ok", ok);
  node.classList.toggle("bad", !ok);
}

function apply(snapshot, full) {
  const cutoff = snapshot.at - RING_S;
  for (const [model, samples] of Object.entries(snapshot.series || {})) {
    const kept = full ? [] : state.series[model] || [];
    const seen = kept.length ? kept[kept.length - 1].at : -Infinity;
    state.series[model] = kept.concat(samples.filter((s) => s.at > seen)).filter((s) => s.at >= cutoff);
  }
  state.snapshot = snapshot;
  state.lastEventAt = Date.now();
  state.events += 1;
  live(`live · ${fmt.time(snapshot.at)}`, true);
  render(snapshot);
}

// --- panels -------------------------------------------------------------------------------------------------

function render(snap) {
  renderSummary(snap);
  renderModels(snap);
  renderWorkers(snap);
  renderDispatchers(snap);
  renderDeadLetters(snap);
  renderRuns(snap);
}

// The fleet at a glance: the same numbers as the cards and the workers table, added up.
function fleetCounts(snap) {
  const sum = (key) => {
    const known = snap.models.map((m) => m[key]).filter((v) => v !== null && v !== undefined);
    return known.length ? known.reduce((a, b) => a + b, 0) : null;
  };
  const workers = snap.workers || [];
  const count = (s) => workers.filter((w) => w.state === s).length;
  return {
    models: snap.models.length,
    paused: snap.models.filter((m) => m.paused).length,
    ready: count("ready"),
    starting: count("starting") + snap.models.reduce((a, m) => a + (m.unheard_replicas || 0), 0),
    draining: count("draining"),
    degraded: count("degraded"),
    waiting: sum("lag"),
    throughput: sum("throughput_per_s"),
    errors: sum("error_rate"),
    dead: snap.models.reduce((a, m) => a + (m.dead_letters || 0), 0),
  };
}

function renderSummary(snap) {
  const c = fleetCounts(snap);
  const put = (key, text, warn = false) => {
    const box = $("summary").querySelector(`[data-summary="${key}"]`);
    setText(box.querySelector("dd"), text);
    box.classList.toggle("warn", warn);
  };
  put("models", `${c.models}${c.paused ? ` (${c.paused} paused)` : ""}`);
  const extra = [c.draining && `${c.draining} draining`, c.degraded && `${c.degraded} degraded`].filter(Boolean);
  put("workers", [`${c.ready} ready`, `${c.starting} starting`, ...extra].join(" · "), c.degraded > 0);
  put("waiting", c.waiting ?? "–");
  put("throughput", c.throughput === null ? "–" : `${fmt.rate(c.throughput)}/s`);
  put("errors", `${c.errors === null ? "–" : `${fmt.rate(c.errors)}/s`} · ${c.dead} dead letter${c.dead === 1 ? "" : "s"}`,
    (c.errors || 0) > 0 || c.dead > 0);
}

function renderModels(snap) {
  const host = $("models");
  if (!snap.models.length) {
    host.replaceChildren(el("p", { class: "empty" }, "No models are served: start the gateway with --models."));
    return;
  }
  host.querySelector(":scope > .empty")?.remove();
  for (const panel of snap.models) {
    let card = host.querySelector(`.model[data-model="${CSS.escape(panel.model)}"]`);
    if (!card) {
      card = modelCard(panel.model);
      host.append(card);
      state.charts[panel.model] = new ModelCharts(card);
    }
    updateModelCard(card, panel, snap);
    state.charts[panel.model].update(state.series[panel.model] || []);
  }
}

function stat(label, key) {
  return el("span", { class: "stat" }, `${label} `, el("b", { dataset: { stat: key } }, "–"));
}

function modelCard(model) {
  const id = (suffix) => `${model}-${suffix}`.replace(/[^A-Za-z0-9_-]/g, "_");
  const chart = (key, title) =>
    el("div", { class: "chart", dataset: { chart: key } }, el("h3", {}, title), el("div", { class: "plot" }));
  const details = el(
    "details",
    { class: "model-details" },
    el(
      "summary",
      { class: "model-head", title: `${model}: show or hide its charts, decisions and controls` },
      el("h3", { id: id("title") }, model),
      el("span", { class: "badge pool", dataset: { badge: "pool" }, hidden: true }),
      stat("replicas", "replicas"),
      stat("desired", "desired"),
      stat("workers", "workers"),
      stat("waiting", "waiting"),
      stat("throughput", "throughput"),
      stat("p99", "p99"),
      stat("errors", "errors"),
      el("span", { class: "badge paused", dataset: { badge: "paused" }, hidden: true }, "autoscaling paused"),
      el("span", { class: "badge pinned", dataset: { badge: "pinned" }, hidden: true }),
      el("p", { class: "reason", dataset: { role: "reason" } }),
    ),
    el(
      "div",
      { class: "model-more" },
      stat("bounds", "bounds"),
      stat("arrival", "arrival"),
      stat("p50", "p50"),
      stat("dead letters", "dead"),
    ),
    el(
      "div",
      { class: "charts" },
      chart("lag", "Queue lag (requests waiting)"),
      chart("rates", "Rates (/s): arrival, throughput, errors, dead letters"),
      chart("latency", "Latency (ms): p50, p99"),
      chart("replicas", "Replicas: current, desired"),
    ),
    el("h3", { class: "muted" }, "Autoscaler decisions (last 15 minutes)"),
    el("div", { class: "timeline", dataset: { role: "timeline" }, "aria-hidden": "true" }),
    el("ul", { class: "decisions", dataset: { role: "decisions" }, "aria-label": `decisions for ${model}` }),
    controls(model, id),
  );
  // a closed card's charts have no width: size them when the card opens
  details.addEventListener("toggle", () => details.open && state.charts[model]?.resize());
  return el("article", { class: "model", dataset: { model }, "aria-labelledby": id("title") }, details);
}

function controls(model, id) {
  const bounds = el(
    "form",
    { class: "inline-form", "aria-label": `replica bounds of ${model}`, onsubmit: (e) => setBounds(e, model) },
    el("label", { for: id("min") }, "min"),
    el("input", { id: id("min"), name: "min", type: "number", min: "0", step: "1", inputmode: "numeric" }),
    el("label", { for: id("max") }, "max"),
    el("input", { id: id("max"), name: "max", type: "number", min: "1", step: "1", inputmode: "numeric" }),
    el("button", { type: "submit", dataset: { action: "bounds" } }, "Set bounds"),
  );
  const pause = el("button", { type: "button", dataset: { action: "pause" }, onclick: () => togglePause(model) }, "Pause autoscaling");
  const scale = el(
    "form",
    { class: "inline-form", "aria-label": `scale ${model} now`, onsubmit: (e) => scaleNow(e, model) },
    el("label", { for: id("n") }, "scale to"),
    el("input", { id: id("n"), name: "n", type: "number", min: "0", step: "1", required: true }),
    el("label", { for: id("ttl") }, "for (s)"),
    el("input", { id: id("ttl"), name: "ttl", type: "number", min: "1", step: "1", value: "600", required: true }),
    el("button", { type: "submit", dataset: { action: "scale" } }, "Scale now"),
    el("button", { type: "button", dataset: { action: "unpin" }, onclick: () => unpin(model) }, "End override"),
  );
  return el("div", { class: "controls" }, bounds, pause, scale);
}

function updateModelCard(card, m, snap) {
  const put = (key, text) => setText(card.querySelector(`[data-stat="${key}"]`), text);
  put("replicas", m.current_replicas);
  put("desired", m.desired_replicas);
  put("workers", `${m.ready_workers} ready${m.starting_workers ? `, ${m.starting_workers} starting` : ""}`);
  put("bounds", `${m.min_replicas} to ${m.max_replicas}`);
  put("waiting", m.lag ?? "–");
  put("arrival", `${fmt.rate(m.arrival_rate)}/s`);
  put("throughput", `${fmt.rate(m.throughput_per_s)}/s`);
  setText(card.querySelector('[data-role="reason"]'), m.reason || "");
  put("p50", fmt.ms(m.latency_p50_ms));
  put("p99", fmt.ms(m.latency_p99_ms));
  put("errors", `${fmt.rate(m.error_rate)}/s`);
  put("dead", `${m.dead_letters} (${fmt.rate(m.dead_letter_rate)}/s)`);
  card.querySelector('[data-badge="paused"]').hidden = !m.paused;
  const pool = card.querySelector('[data-badge="pool"]');
  pool.hidden = !m.pool;
  if (m.pool) setText(pool, `pool of ${m.pool.join(", ")}`);
  const pinned = card.querySelector('[data-badge="pinned"]');
  pinned.hidden = !m.pinned;
  if (m.pinned) setText(pinned, `held at ${m.pinned.replicas} until ${fmt.time(m.pinned.until)}`);
  setText(card.querySelector('[data-action="pause"]'), m.paused ? "Resume autoscaling" : "Pause autoscaling");
  card.dataset.paused = m.paused;
  const min = card.querySelector('input[name="min"]');
  const max = card.querySelector('input[name="max"]');
  min.placeholder = m.min_replicas;
  max.placeholder = m.max_replicas;
  renderDecisions(card, (snap.decisions || {})[m.model] || [], snap.at);
}

function renderDecisions(card, decisions, now) {
  const line = card.querySelector('[data-role="timeline"]');
  line.replaceChildren(
    ...decisions.map((d) =>
      el("span", {
        class: d.changed ? "tick changed" : "tick",
        style: `left: ${Math.max(0, Math.min(100, 100 - ((now - d.at) / RING_S) * 100))}%`,
        title: `${fmt.time(d.at)} ${d.current_replicas} → ${d.replicas}: ${d.reason}`,
        dataset: { repeats: d.repeats },
      }),
    ),
  );
  const list = card.querySelector('[data-role="decisions"]');
  if (!decisions.length) {
    list.replaceChildren(el("li", { class: "empty" }, "No decisions yet: the autoscaler records one each time it acts."));
    return;
  }
  list.replaceChildren(
    ...decisions.slice(0, 30).map((d) =>
      el("li", { dataset: { changed: d.changed, repeats: d.repeats } }, el("time", {}, fmt.time(d.at)),
        `${d.current_replicas} → ${d.replicas}${d.changed ? "" : " (kept)"}: ${d.reason}`,
        d.repeats > 1 ? el("span", { class: "muted" }, ` · unchanged since ${fmt.time(d.since)} (${d.repeats} checks)`) : ""),
    ),
  );
}

// A replica the autoscaler started whose worker has not sent a heartbeat yet (it is loading): a row of its own,
// so that the workers listed add up to the replicas a card shows.
function launching(snap) {
  return snap.models.flatMap((m) => Array.from({ length: m.unheard_replicas || 0 }, (_, i) => ({
    worker_id: `${m.model}#launching-${i + 1}`, model: m.model, state: "launching", launching: true,
  })));
}

// A worker's circuit breaker (its heartbeat's "breaker"), in words.
const BREAKER_STATES = { closed: "closed", open: "open (takes no work)", half_open: "half-open (probing)" };

// The versions a worker holds loaded and warm ("v1, v2"); a multi-model worker that loaded none yet says so.
function loadedVersions(w) {
  const loaded = w.loaded || [];
  return loaded.length ? loaded.map((v) => `v${v}`).join(", ") : "– (none yet)";
}

const GIB = 1024 ** 3;

// A worker's GPUs and the device memory of its loaded versions, from its heartbeat ("" without a GPU).
function gpuText(w) {
  const gpus = (w.gpus || []).map((g) =>
    `GPU ${g.index}: ${Math.round(g.utilization_pct)} %, ${fmt.num(g.memory_used_bytes / GIB, 1)}/${fmt.num(g.memory_total_bytes / GIB, 0)} GiB`);
  const models = Object.entries(w.model_memory_bytes || {}).map(([v, b]) => `v${v}: ${fmt.num(b / GIB, 2)} GiB`);
  return [...gpus, ...models].join(" · ");
}

function renderWorkers(snap) {
  const tbody = $("workers").querySelector("tbody");
  const rows = [...snap.workers, ...launching(snap)].sort((a, b) => a.model.localeCompare(b.model));
  syncRows(
    tbody,
    rows,
    (w) => w.worker_id,
    (w) => el("tr", {}, ...Array.from({ length: 14 }, () => el("td")),
      el("td", {}, w.launching ? "" : el("button", { type: "button", onclick: () => drain(w.worker_id) }, "Drain"))),
    (row, w) => {
      if (w.launching) {
        const cells = ["(no heartbeat yet)", w.model, "–", "launching", "–", "–", "–", "–", "–", "–", "–", "–", "–", ""];
        cells.forEach((text, i) => setText(row.children[i], text));
        row.children[3].className = "state state-warming";
        row.children[3].title = "started by the autoscaler, still loading: its first heartbeat names it";
        row.dataset.state = "launching";
        return;
      }
      const shown = WORKER_STATES[w.state] || w.state;
      const idle = "– (no job yet)";
      const cells = [w.worker_id, w.model, w.device, shown, w.in_flight, w.items, w.items ? fmt.num(w.mean_batch_size, 1) : "–",
        w.items ? fmt.ms(w.latency_ewma_ms) : idle, fmt.ms(w.latency_p99_ms), fmt.age(w.heartbeat_age_s),
        loadedVersions(w), w.replicas ?? 1, BREAKER_STATES[w.breaker] || w.breaker || "closed", gpuText(w)];
      cells.forEach((text, i) => setText(row.children[i], text ?? "–"));
      row.children[10].dataset.role = "loaded";
      row.children[11].dataset.role = "replicas";
      row.children[12].dataset.role = "breaker";
      row.children[12].className = `breaker breaker-${w.breaker || "closed"}`;
      row.dataset.breaker = w.breaker || "closed";
      row.children[13].dataset.role = "gpus";
      row.children[3].className = `state state-${shown}`;
      row.dataset.state = shown;
      row.querySelector("button").disabled = shown === "draining";
      row.querySelector("button").setAttribute("aria-label", `Drain worker ${w.worker_id}`);
    },
  );
  // The GPU column only where some worker has a GPU: a CPU fleet shows no empty column.
  const anyGpu = snap.workers.some((w) => (w.gpus || []).length > 0);
  $("workers").querySelector('th[data-role="gpus"]').hidden = !anyGpu;
  for (const row of tbody.children) row.children[13].hidden = !anyGpu;
  const missing = snap.models.map((m) => m.model).filter((m) => !snap.workers.some((w) => w.model === m));
  setText($("workers-empty"), missing.map((m) => `no workers for ${m}: start one with \`fleet worker --model ${m}\``).join(" · "));
}

function renderDispatchers(snap) {
  const tbody = $("dispatchers").querySelector("tbody");
  const list = snap.dispatchers || [];
  syncRows(tbody, list, (d) => d.dispatcher_id, () => el("tr", {}, ...Array.from({ length: 9 }, () => el("td"))),
    (row, d) => {
      const outstanding = Object.entries(d.outstanding || {}).map(([w, n]) => `${w}: ${n}`).join(", ") || "none";
      const cells = [d.dispatcher_id, d.model, d.policy, d.idle_queue_length, fmt.pct(d.idle_share),
        fmt.pct(d.amnesia_share), fmt.pct(d.fallback_share), outstanding, fmt.age(d.heartbeat_age_s)];
      cells.forEach((text, i) => setText(row.children[i], text ?? "–"));
    });
  setText($("dispatchers-empty"), list.length ? "" :
    "No dispatchers: workers pull from the queue. Start one with `fleet dispatcher --model <model>` to assign jobs directly (JIQ).");
}

function renderDeadLetters(snap) {
  const host = $("dead-letters");
  const byModel = snap.dead_letters || {};
  const models = Object.keys(byModel).filter((m) => byModel[m].count > 0);
  const signature = JSON.stringify(models.map((m) => [m, byModel[m].count, byModel[m].latest.map((l) => l.letter_id)]));
  if (signature === state.deadSignature) return; // unchanged: keep the checkboxes (and the keyboard's focus)
  state.deadSignature = signature;
  const present = new Set();
  if (!models.length) {
    host.replaceChildren(el("p", { class: "empty" }, "No dead letters: every job that failed for good would show here, to redrive or purge."));
  } else {
    host.replaceChildren(...models.map((model) => {
      const { count, latest } = byModel[model];
      return el("div", { class: "dead-model", dataset: { model } },
        el("h3", {}, `${model}: ${count} dead letter${count === 1 ? "" : "s"}`,
          latest.length < count ? el("span", { class: "muted" }, ` (latest ${latest.length} shown)`) : ""),
        el("ul", {}, latest.map((letter) => {
          present.add(letter.letter_id);
          const box = el("input", {
            type: "checkbox", id: `dl-${letter.letter_id}`, value: letter.letter_id,
            checked: state.selected.has(letter.letter_id),
            "aria-label": `select the dead letter of ${letter.job_id || letter.letter_id}`,
            onchange: (e) => { e.target.checked ? state.selected.add(letter.letter_id) : state.selected.delete(letter.letter_id); selection(); },
          });
          return el("li", { dataset: { letter: letter.letter_id, job: letter.job_id || "" } }, el("label", { for: box.id },
            box, el("code", {}, letter.job_id || letter.letter_id),
            el("span", { class: "error" }, `${letter.error?.type || "error"}: ${letter.error?.message || ""}`),
            el("span", { class: "muted" }, `${fmt.time(letter.at)} · ${letter.deliveries} deliveries · ${letter.worker_id || "?"}`),
            letter.redrivable === false ? el("span", { class: "muted" }, "(cannot be redriven: purge only)") : ""));
        })));
    }));
  }
  for (const id of [...state.selected]) if (!present.has(id)) state.selected.delete(id);
  selection();
}

function selection() {
  const n = state.selected.size;
  $("redrive").disabled = $("purge").disabled = n === 0;
  setText($("dead-selected"), n ? `${n} selected` : "none selected");
}

function renderRuns(snap) {
  const runs = snap.runs || [];
  syncRows($("runs").querySelector("tbody"), runs, (r) => r.run_id,
    (r) => el("tr", {},
      el("td", {}, el("button", {
        type: "button", class: "link", title: r.run_id, "aria-label": `Show run ${r.run_id}`,
        onclick: () => openRun(r.run_id, r.dag),
      }, r.run_id.length > 14 ? `${r.run_id.slice(0, 12)}…` : r.run_id)),
      el("td"), el("td"), el("td"), el("td"),
      el("td", {}, el("button", { type: "button", dataset: { action: "cancel-run" }, onclick: () => cancelRun(r.run_id) }, "Cancel"))),
    (row, r) => {
      setText(row.children[1], r.dag);
      setText(row.children[2], r.state);
      row.children[2].className = `state state-${r.state}`;
      setText(row.children[3], fmt.time(r.started_at));
      setText(row.children[4], fmt.time(r.finished_at));
      row.children[5].querySelector("button").hidden = r.state !== "running";
      row.classList.toggle("selected", runView.runId === r.run_id);
    });
  setText($("runs-empty"), runs.length ? "" : "No DAG runs yet: start one with `fleet dag run <name>` or POST /v1/dags/{name}/runs.");
}

// --- the audit log (GET /v1/audit, polled: it changes only when someone acts) -------------------------------

async function refreshAudit() {
  try {
    const answer = await get(`/v1/audit?limit=${AUDIT_SHOWN}`);
    state.audit = answer.entries;
    renderAudit();
  } catch (exc) {
    if (exc instanceof ApiError && exc.isAuth) return refused(exc);
    setText($("audit-empty"), `Cannot read the audit log: ${describe(exc)}`);
  }
}

function renderAudit() {
  const entries = state.audit;
  syncRows($("audit").tBodies[0], entries, (e) => `${e.at}|${e.action}|${e.target}`, () => {
    const row = el("tr");
    for (let i = 0; i < 6; i += 1) row.append(el("td"));
    return row;
  }, (row, e) => {
    const cells = row.children;
    setText(cells[0], fmt.time(e.at));
    setText(cells[1], e.action);
    setText(cells[2], e.target ?? "–");
    setText(cells[3], e.key_id ? `key ${e.key_id}` : e.actor);
    setText(cells[4], e.tenant ?? "–");
    setText(cells[5], JSON.stringify(e.details));
  });
  setText($("audit-empty"), entries.length ? "" : "No operator actions recorded yet.");
}

// --- rollouts: versions, shares, breakers and the controller's decisions (GET /v1/rollouts, polled) -------------

const rollouts = new RolloutsPanel($("rollouts"), (...args) => act(...args).then(refreshRollouts));

async function refreshRollouts() {
  try {
    state.rollouts = await get("/v1/rollouts");
    rollouts.render(state.rollouts);
  } catch (exc) {
    if (exc instanceof ApiError && exc.isAuth) return refused(exc);
    setText($("rollouts-error"), `Cannot read the rollouts: ${describe(exc)}`);
    return;
  }
  setText($("rollouts-error"), "");
}

// --- usage: device time and cost per model and tenant (GET /v1/usage, polled and on a change of the form) ------

const usage = new UsagePanel($("usage-form"), $("usage"), $("usage-note"));
$("usage-form").addEventListener("change", () => refreshUsage());
$("usage-form").addEventListener("submit", (event) => event.preventDefault());

async function refreshUsage() {
  try {
    usage.render(await get(usage.query()));
  } catch (exc) {
    if (exc instanceof ApiError && exc.isAuth) return refused(exc);
    setText($("usage-error"), `Cannot read the usage: ${describe(exc)}`);
    return;
  }
  setText($("usage-error"), "");
}

// --- jobs: the lookup and the job history (GET /v1/jobs, filtered, paged, polled) --------------------------

const lookup = new JobLookup($("job-detail"), (jobId) => cancelJobById(jobId), (exc) => refused(exc));

async function refreshRecent() {
  try {
    const query = historyQuery(state.history, RECENT_SHOWN);
    state.recent = await get(`/v1/jobs?${query}`);
    renderRecent($("recent-jobs"), $("recent-empty"), $("recent-scope"), state.recent, (id) => lookup.open(id));
    $("history-older").disabled = !state.recent.next_cursor;
    $("history-newest").disabled = !state.history.cursor;
  } catch (exc) {
    if (exc instanceof ApiError && exc.isAuth) return refused(exc);
    setText($("recent-empty"), `Cannot read the recent jobs: ${describe(exc)}`);
  }
}

function filterHistory(event) {
  event.preventDefault();
  const form = event.target;
  state.history = { model: form.model.value.trim(), state: form.state.value, cursor: null };
  refreshRecent();
}

function pageHistory(older) {
  state.history = { ...state.history, cursor: older ? state.recent?.next_cursor ?? null : null };
  refreshRecent();
}

function lookUp(event) {
  event.preventDefault();
  const id = event.target.job_id.value.trim();
  if (id) lookup.open(id);
}

// --- controls -----------------------------------------------------------------------------------------------

function result(text, ok) {
  const node = $("result");
  node.textContent = text;
  node.className = `result ${ok ? "ok" : "error"}`;
}

async function act(title, body, okLabel, method, path, payload, done) {
  if (!(await confirmAction(title, body, okLabel))) return result(`${title}: not done (cancelled)`, true);
  try {
    const answer = await call(method, path, payload);
    result(done(answer), true);
    refreshAudit();
  } catch (exc) {
    result(`${title} failed: ${describe(exc)}`, false);
    if (exc instanceof ApiError && exc.isAuth) refused(exc);
  }
}

const panelOf = (model) => (state.snapshot?.models || []).find((m) => m.model === model);
const scalingPath = (model) => `/v1/scaling/${encodeURIComponent(model)}`;

function setBounds(event, model) {
  event.preventDefault();
  const form = event.target;
  const body = {};
  if (form.min.value !== "") body.min_replicas = Number(form.min.value);
  if (form.max.value !== "") body.max_replicas = Number(form.max.value);
  if (!Object.keys(body).length) return result("Set bounds: enter a min, a max or both", false);
  const words = Object.entries(body).map(([k, v]) => `${k.replace("_replicas", "")} ${v}`).join(", ");
  act(`Set the bounds of ${model}`, `The autoscaler keeps ${model} within ${words} replicas.`, "Set bounds",
    "PUT", scalingPath(model), body, (s) => {
      form.reset();
      return `${model}: replicas between ${s.min_replicas} and ${s.max_replicas}`;
    });
}

function togglePause(model) {
  const paused = !panelOf(model)?.paused;
  act(paused ? `Pause autoscaling of ${model}` : `Resume autoscaling of ${model}`,
    paused ? `The autoscaler keeps ${model}'s replica count whatever the signals say, until resumed.`
      : `The autoscaler decides ${model}'s replicas from its signals again.`,
    paused ? "Pause" : "Resume", "PUT", scalingPath(model), { paused },
    (s) => `${model}: autoscaling ${s.paused ? "paused" : "resumed"}`);
}

function scaleNow(event, model) {
  event.preventDefault();
  const form = event.target;
  const replicas = Number(form.n.value);
  const ttl = Number(form.ttl.value);
  act(`Scale ${model} to ${replicas}`, `${model} runs ${replicas} replica${replicas === 1 ? "" : "s"} now, held for ${ttl} s; then the autoscaler decides again.`,
    "Scale now", "POST", `${scalingPath(model)}/scale`, { replicas, ttl_s: ttl },
    (s) => `${model}: scaling to ${replicas} for ${ttl} s (now ${s.current_replicas ?? "?"} running)`);
}

function unpin(model) {
  act(`End the override of ${model}`, `The autoscaler decides ${model}'s replicas from its signals again.`, "End override",
    "DELETE", `${scalingPath(model)}/scale`, undefined, () => `${model}: override removed`);
}

function drain(workerId) {
  act(`Drain worker ${workerId}`, `${workerId} stops fetching, finishes and settles the jobs it holds, then exits.`, "Drain",
    "POST", `/v1/workers/${encodeURIComponent(workerId)}/drain`, undefined, (a) => `${a.worker_id}: ${a.state}`);
}

function deadLetters(kind) {
  const ids = [...state.selected];
  const redrive = kind === "redrive";
  act(redrive ? `Redrive ${ids.length} dead letter${ids.length === 1 ? "" : "s"}` : `Purge ${ids.length} dead letter${ids.length === 1 ? "" : "s"}`,
    redrive ? "Each job's request goes back on its model's queue as a fresh attempt." : "The letters are deleted for good; their jobs stay failed.",
    redrive ? "Redrive" : "Purge", "POST", `/v1/deadletters/${kind}`, { letter_ids: ids }, (a) => {
      const done = redrive ? a.redriven : a.purged;
      done.forEach((id) => state.selected.delete(id));
      selection();
      const refused = Object.entries(a.not_redrivable || {}).map(([id, why]) => `${id}: ${why}`);
      return `${redrive ? "redriven" : "purged"}: ${done.length}${a.missing.length ? `; already gone: ${a.missing.length}` : ""}` +
        (refused.length ? `; not redriven: ${refused.join("; ")}` : "");
    });
}

function cancelRun(runId) {
  act(`Cancel run ${runId}`, "Steps not yet finished are cancelled; the run ends cancelled.", "Cancel run",
    "POST", `/v1/runs/${encodeURIComponent(runId)}/cancel`, undefined, (a) => `run ${runId}: ${a.state ?? "cancelled"}`);
}

function cancelJob(event) {
  event.preventDefault();
  cancelJobById(event.target.job_id.value.trim());
}

function cancelJobById(id) {
  act(`Cancel job ${id}`, "A queued or running job ends cancelled; a finished job keeps its result.", "Cancel job",
    "POST", `/v1/jobs/${encodeURIComponent(id)}/cancel`, undefined, (a) => {
      if (lookup.jobId === id) lookup.open(id);
      return `job ${id}: ${a.state ?? "cancelled"}`;
    });
}

const runView = new RunView($("run-detail"), (exc) => {
  if (exc instanceof ApiError && exc.isAuth) refused(exc);
});

function openRun(runId, dag) {
  runView.open(runId, dag);
  for (const row of $("runs").querySelectorAll("tbody tr")) row.classList.toggle("selected", row.dataset.key === runId);
}

// --- theme --------------------------------------------------------------------------------------------------

function applyTheme(theme) {
  if (theme) document.documentElement.dataset.theme = theme;
  const dark = theme ? theme === "dark" : matchMedia("(prefers-color-scheme: dark)").matches;
  const button = $("theme-toggle");
  button.setAttribute("aria-pressed", String(dark));
  button.textContent = dark ? "Light theme" : "Dark theme";
  for (const charts of Object.values(state.charts)) charts.build();
}

// The stream sends a snapshot every second: say so when it has gone quiet.
setInterval(() => {
  if (state.lastEventAt && !$("main").hidden && Date.now() - state.lastEventAt > 3000) {
    live(`stale: no update for ${Math.round((Date.now() - state.lastEventAt) / 1000)} s`, false);
  }
}, 1000);

function wire() {
  applyTheme(localStorage.getItem("fleet.theme"));
  // following the system's scheme until the toggle picks one
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => {
    if (!localStorage.getItem("fleet.theme")) applyTheme(null);
  });
  $("theme-toggle").addEventListener("click", () => {
    const dark = $("theme-toggle").getAttribute("aria-pressed") === "true";
    const next = dark ? "light" : "dark";
    localStorage.setItem("fleet.theme", next);
    applyTheme(next);
  });
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    token.set($("token").value);
    $("token").value = "";
    $("logout").hidden = false;
    connect();
  });
  $("logout").addEventListener("click", () => {
    token.clear();
    showLogin("Logged out.");
  });
  $("redrive").addEventListener("click", () => deadLetters("redrive"));
  $("purge").addEventListener("click", () => deadLetters("purge"));
  $("cancel-job-form").addEventListener("submit", cancelJob);
  $("job-lookup-form").addEventListener("submit", lookUp);
  $("history-filter").addEventListener("submit", filterHistory);
  $("history-older").addEventListener("click", () => pageHistory(true));
  $("history-newest").addEventListener("click", () => pageHistory(false));
  let resizing = null;
  addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => Object.values(state.charts).forEach((c) => c.resize()), 150);
  });
}

wire();
start();
