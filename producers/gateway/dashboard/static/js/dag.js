// A DAG run's graph: the DAG's nodes and edges (GET /v1/dags/{name}) drawn with Mermaid, each step coloured and
// labelled with its state, redrawn as /v1/runs/{id}/events reports step changes. Mermaid (2.6 MB) is loaded the
// first time a run is opened, not with the page.
/* global mermaid */
import { ApiError, get, stream } from "./api.js";
import { el, fmt } from "./dom.js";

const MERMAID_SRC = "/dashboard/static/vendor/mermaid/mermaid.min.js";
const STATE_STYLES = {
  pending: "fill:#eef0f3,stroke:#8c959f,color:#1b1f24",
  running: "fill:#fff4d6,stroke:#bf8700,color:#1b1f24",
  succeeded: "fill:#dafbe1,stroke:#1a7f37,color:#1b1f24",
  failed: "fill:#ffebe9,stroke:#cf222e,color:#1b1f24",
  skipped: "fill:#f6f8fa,stroke:#8c959f,color:#57606a,stroke-dasharray:4 3",
  cancelled: "fill:#f6f8fa,stroke:#57606a,color:#57606a",
};

let loading = null;
let renders = 0;

function loadMermaid() {
  if (!loading) {
    loading = new Promise((resolve, reject) => {
      const script = el("script", { src: MERMAID_SRC });
      script.addEventListener("load", () => {
        const dark = document.documentElement.dataset.theme === "dark" ||
          (!document.documentElement.dataset.theme && matchMedia("(prefers-color-scheme: dark)").matches);
        mermaid.initialize({ startOnLoad: false, securityLevel: "strict", theme: dark ? "dark" : "default" });
        resolve(mermaid);
      });
      script.addEventListener("error", () => reject(new Error("could not load the graph library")));
      document.head.append(script);
    });
  }
  return loading;
}

function quote(text) {
  return `"${String(text).replace(/"/g, "#quot;")}"`;
}

export function mermaidText(graph, steps) {
  const ids = new Map(graph.nodes.map((node, i) => [node.id, `s${i}`]));
  const lines = ["flowchart LR"];
  for (const node of graph.nodes) {
    const step = steps[node.id] || { state: "pending", items: { total: 0, done: 0 } };
    const items = step.items && step.items.total > 1 ? ` ${step.items.done}/${step.items.total}` : "";
    lines.push(`  ${ids.get(node.id)}[${quote(`${node.id} (${node.model}): ${step.state}${items}`)}]:::${step.state}`);
  }
  for (const edge of graph.edges) {
    const arrow = edge.kind === "after" ? "-.->" : "-->";
    lines.push(`  ${ids.get(edge.from)} ${arrow} ${ids.get(edge.to)}`);
  }
  for (const [state, style] of Object.entries(STATE_STYLES)) lines.push(`  classDef ${state} ${style}`);
  return lines.join("\n");
}

// One open run at a time: opening another aborts the previous run's event stream.
export class RunView {
  constructor(host, onError) {
    this.host = host;
    this.onError = onError;
    this.controller = null;
    this.graphs = new Map();
    this.runId = null;
  }

  async open(runId, dagName) {
    if (this.controller) this.controller.abort();
    this.controller = new AbortController();
    this.runId = runId;
    this.host.replaceChildren(el("p", { class: "muted" }, `Loading run ${runId}…`));
    try {
      const [run, graph] = await Promise.all([get(`/v1/runs/${encodeURIComponent(runId)}`), this.graph(dagName)]);
      await this.draw(run, graph);
      this.follow(runId, graph, this.controller.signal);
    } catch (exc) {
      this.host.replaceChildren(el("p", { class: "error" }, exc instanceof ApiError ? exc.describe() : exc.message));
      this.onError(exc);
    }
  }

  async graph(name) {
    if (!this.graphs.has(name)) this.graphs.set(name, (await get(`/v1/dags/${encodeURIComponent(name)}`)).graph);
    return this.graphs.get(name);
  }

  follow(runId, graph, signal) {
    let pending = null;
    const onEvent = (name, data) => {
      if (!data.run || this.runId !== runId) return;
      pending = data.run;
      // several step events can arrive at once: draw the latest view once per frame
      requestAnimationFrame(() => {
        if (pending && this.runId === runId) this.draw(pending, graph);
        pending = null;
      });
    };
    stream(`/v1/runs/${encodeURIComponent(runId)}/events`, onEvent, signal).catch((exc) => this.onError(exc));
  }

  async draw(run, graph) {
    const lib = await loadMermaid();
    const { svg } = await lib.render(`run-graph-${++renders}`, mermaidText(graph, run.steps));
    if (this.runId !== run.run_id) return;
    const picture = el("div", { class: "run-graph", role: "img", "aria-label": `graph of run ${run.run_id}` });
    picture.innerHTML = svg; // Mermaid's output, rendered with securityLevel "strict" (labels sanitised)
    const steps = el(
      "ul",
      { class: "steps", "aria-label": "steps and their states" },
      Object.entries(run.steps).map(([id, step]) =>
        el("li", { dataset: { step: id, state: step.state } }, `${id}: `,
          el("span", { class: `state state-${step.state}` }, step.state)),
      ),
    );
    const head = el(
      "p", {},
      el("b", {}, run.dag), ` run `, el("code", {}, run.run_id), " is ",
      el("span", { class: `state state-${run.state}`, id: "run-state" }, run.state),
      ` · started ${fmt.time(run.created_at)}`, run.finished_at ? ` · finished ${fmt.time(run.finished_at)}` : "",
    );
    this.host.replaceChildren(head, picture, steps);
    this.host.dataset.runId = run.run_id;
    this.host.dataset.state = run.state;
  }
}
