// The usage panel: device-seconds and their cost per model and tenant (GET /v1/usage, polled), over a range the
// operator picks, grouped as picked; the cost per 1,000 requests beside each row and the prices it used.
import { el, setText, syncRows } from "./dom.js";

export const USAGE_EVERY_MS = 30000;

const money = (v, currency) => `${Number(v).toFixed(v >= 100 ? 2 : 4)} ${currency}`;
const seconds = (v) => (v >= 3600 ? `${(v / 3600).toFixed(2)} h` : `${Number(v).toFixed(v >= 10 ? 1 : 3)} s`);

export class UsagePanel {
  // form: the range and grouping selects; table: its tbody is filled; note: the window and the prices
  constructor(form, table, note) {
    this.form = form;
    this.table = table;
    this.note = note;
  }

  query() {
    const data = new FormData(this.form);
    return `/v1/usage?group_by=${encodeURIComponent(data.get("group_by"))}&from=${encodeURIComponent(data.get("range"))}`;
  }

  render(report) {
    const fields = report.group_by;
    const head = this.table.querySelector("thead tr");
    const names = [...fields, "jobs", "items", "device time", "cost", "per 1k requests"];
    if (head.dataset.fields !== fields.join(",")) {
      head.replaceChildren(...names.map((h) => el("th", { scope: "col" }, h)));
      head.dataset.fields = fields.join(",");
      this.table.querySelector("tbody").replaceChildren();
    }
    const rows = report.rows.length ? [...report.rows, { ...report.total, total: true }] : [];
    syncRows(this.table.querySelector("tbody"), rows,
      (r) => (r.total ? "(total)" : fields.map((f) => r[f]).join("|")),
      () => el("tr", {}, names.map((_, i) => el(i < fields.length ? "th" : "td", i < fields.length ? { scope: "row" } : {}))),
      (row, r) => {
        const cells = [...fields.map((f, i) => (r.total ? (i === 0 ? "total" : "") : r[f])), String(r.jobs), String(r.items),
          seconds(r.device_seconds), money(r.cost, report.currency),
          r.cost_per_1k_requests === null ? "–" : money(r.cost_per_1k_requests, report.currency)];
        cells.forEach((text, i) => setText(row.children[i], text));
        row.classList.toggle("total", Boolean(r.total));
      });
    const prices = Object.entries(report.prices).map(([k, v]) => `${k} ${v}`).join(", ") || "none set (FLEET_PRICE_PER_DEVICE_HOUR)";
    const from = new Date(report.from * 1000).toLocaleString();
    const empty = report.rows.length ? "" : "No usage in this range. ";
    setText(this.note, `${empty}From ${from}, in whole hours; price per device-hour: ${prices}.`);
  }
}
