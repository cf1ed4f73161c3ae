// Jobs: look one up by id (GET /v1/jobs/{id} with the operator's credentials, which read every tenant's jobs) and
// the job history (GET /v1/jobs: every tenant's jobs for the operator token, newest first, filtered by model and
// state, a page at a time; polled, so each row shows its state now).
import { ApiError, get } from "./api.js";
import { el, fmt, setText, syncRows } from "./dom.js";

const TERMINAL = new Set(["succeeded", "failed", "cancelled", "expired"]);
const OUTPUT_SHOWN = 2000; // characters of a job's output shown; the rest is cut with a note

export function took(job) {
  if (!job.finished_at) return "–";
  return fmt.duration(job.finished_at - job.created_at);
}

function outputText(output) {
  const text = JSON.stringify(output, null, 2) ?? "null";
  return text.length > OUTPUT_SHOWN ? `${text.slice(0, OUTPUT_SHOWN)}\n… (${text.length - OUTPUT_SHOWN} more characters)` : text;
}

export class JobLookup {
  // host: the detail box; onCancel(jobId): asks for a cancel; onAuth(exc): a refused credential.
  constructor(host, onCancel, onAuth) {
    this.host = host;
    this.onCancel = onCancel;
    this.onAuth = onAuth;
    this.jobId = null;
  }

  async open(jobId) {
    this.jobId = jobId;
    this.host.hidden = false;
    this.host.dataset.jobId = jobId;
    this.host.replaceChildren(el("p", { class: "muted" }, `looking up ${jobId}…`));
    let job;
    try {
      job = await get(`/v1/jobs/${encodeURIComponent(jobId)}`);
    } catch (exc) {
      if (this.jobId !== jobId) return;
      if (exc instanceof ApiError && exc.isAuth) this.onAuth(exc);
      const why = exc instanceof ApiError && exc.status === 404
        ? `No job ${jobId}: the id is unknown, or its record expired (records are kept for the job TTL).`
        : `Cannot look up ${jobId}: ${exc instanceof ApiError ? exc.describe() : exc.message}`;
      this.host.replaceChildren(el("p", { class: "error", dataset: { role: "lookup-error" } }, why));
      return;
    }
    if (this.jobId === jobId) this.show(job);
  }

  show(job) {
    const row = (label, value, attrs = {}) => [el("dt", {}, label), el("dd", attrs, value ?? "–")];
    const ended = TERMINAL.has(job.state);
    const outcome = job.error
      ? el("pre", { class: "error", dataset: { role: "error" } }, `${job.error.type}: ${job.error.message}`)
      : job.state === "succeeded"
        ? el("pre", { class: "output", dataset: { role: "output" } }, outputText(job.output))
        : el("p", { class: "muted" }, ended ? "no output" : "no output yet: the job has not finished");
    this.host.replaceChildren(
      el("div", { class: "job-head" },
        el("code", {}, job.job_id),
        el("span", { class: `state state-${job.state}`, dataset: { role: "state" } }, job.state),
        ended ? "" : el("button", { type: "button", onclick: () => this.onCancel(job.job_id) }, "Cancel this job"),
        el("button", { type: "button", onclick: () => this.open(job.job_id) }, "Refresh")),
      el("dl", { class: "facts" },
        row("model", job.model, { dataset: { role: "model" } }),
        row("tenant", job.tenant ?? "default", { dataset: { role: "tenant" } }),
        row("submitted", fmt.time(job.created_at)),
        row("started", fmt.time(job.started_at)),
        row("finished", fmt.time(job.finished_at)),
        row("took", took(job)),
        row("worker", job.worker_id),
        row("deliveries", job.deliveries),
        job.cache ? row("from cache", job.cache) : []),
      outcome,
    );
  }
}

// The query of one history page: its filters, its cursor (null: the newest page) and its size.
export function historyQuery(history, limit) {
  const query = new URLSearchParams({ limit: String(limit) });
  if (history.model) query.set("model", history.model);
  if (history.state) query.set("state", history.state);
  if (history.cursor) query.set("cursor", history.cursor);
  return query;
}

export function renderRecent(table, empty, scope, answer, onOpen) {
  const jobs = answer.jobs;
  syncRows(table.tBodies[0], jobs, (j) => j.job_id, (j) => el("tr", {},
    el("td", {}, el("button", {
      type: "button", class: "link", title: j.job_id, "aria-label": `Look up job ${j.job_id}`, onclick: () => onOpen(j.job_id),
    }, j.job_id.length > 14 ? `${j.job_id.slice(0, 12)}…` : j.job_id)),
    el("td"), el("td"), el("td"), el("td"), el("td")),
  (row, j) => {
    const cells = row.children;
    setText(cells[1], j.model);
    setText(cells[2], j.state);
    cells[2].className = `state state-${j.state}`;
    setText(cells[3], fmt.time(j.created_at));
    setText(cells[4], took(j));
    setText(cells[5], j.error ? `${j.error.type}: ${j.error.message}` : "");
    row.dataset.state = j.state;
  });
  setText(scope, "(newest first, kept as long as their records)");
  setText(empty, jobs.length ? "" : answer.next_cursor ? "None on this page: try Older." : "No jobs match.");
}
