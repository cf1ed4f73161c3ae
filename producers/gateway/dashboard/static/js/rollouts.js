// The rollouts panel: each model with a traffic policy (GET /v1/rollouts, polled): its versions with their traffic
// shares, windows (requests, errors, p99, shadow agreement) and breakers, the controller's decisions on a timeline,
// and promote / roll back / set weight, each confirmed in the page's dialog and recorded in the audit log.
import { el, fmt, setText, syncRows } from "./dom.js";

export const ROLLOUTS_EVERY_MS = 2000;
const TIMELINE_S = 15 * 60;
const BREAKER_WORDS = { closed: "closed", open: "open", half_open: "half-open" };
const ACTION_WORDS = { step: "step", promote: "promoted", roll_back: "rolled back", hold: "hold", set: "set", breaker: "breaker" };

const pathOf = (model, what) => `/v1/models/${encodeURIComponent(model)}/${what}`;

export class RolloutsPanel {
  // act(title, body, okLabel, method, path, payload, done): the page's confirmed call (main.js)
  constructor(host, act) {
    this.host = host;
    this.act = act;
    this.views = [];
  }

  render(views, now = Date.now() / 1000) {
    this.views = views;
    if (!views.length) {
      this.host.replaceChildren(el("p", { class: "empty" },
        "No traffic policies: every model serves one version. Set one with `fleet models traffic` or PUT /v1/models/{name}/traffic."));
      return;
    }
    this.host.querySelector(":scope > .empty")?.remove();
    const seen = new Set();
    for (const view of views) {
      seen.add(view.model);
      let card = this.host.querySelector(`.rollout[data-model="${CSS.escape(view.model)}"]`);
      if (!card) {
        card = this.card(view.model);
        this.host.append(card);
      }
      this.update(card, view, now);
    }
    for (const card of this.host.querySelectorAll(".rollout")) if (!seen.has(card.dataset.model)) card.remove();
  }

  card(model) {
    const id = `rollout-${model}`.replace(/[^A-Za-z0-9_-]/g, "_");
    const head = ["Version", "Role", "Share", "Requests", "Errors", "p99", "Agreement", "Breaker"];
    const weight = el("form", { class: "inline-form", "aria-label": `canary weight of ${model}`, onsubmit: (e) => this.setWeight(e, model) },
      el("label", { for: `${id}-weight` }, "canary weight (%)"),
      el("input", { id: `${id}-weight`, name: "weight", type: "number", min: "0", max: "100", step: "any", required: true }),
      el("button", { type: "submit", dataset: { control: "set-weight" } }, "Set weight"));
    return el("article", { class: "rollout", dataset: { model }, "aria-labelledby": `${id}-title` },
      el("div", { class: "rollout-head" },
        el("h3", { id: `${id}-title` }, model),
        el("span", { class: "badge", dataset: { role: "phase" } }),
        el("span", { class: "share-bar", dataset: { role: "shares" }, "aria-hidden": "true" },
          el("span", { class: "primary" }), el("span", { class: "canary" }))),
      el("div", { class: "table-wrap" }, el("table", { class: "versions", "aria-label": `versions of ${model}` },
        el("thead", {}, el("tr", {}, head.map((h) => el("th", { scope: "col" }, h)))), el("tbody"))),
      el("h4", { class: "muted" }, "Controller decisions and breaker changes (last 15 minutes on the line)"),
      el("div", { class: "timeline", dataset: { role: "timeline" }, "aria-hidden": "true" }),
      el("ul", { class: "decisions", dataset: { role: "decisions" }, "aria-label": `rollout decisions for ${model}` }),
      el("div", { class: "controls" },
        el("button", { type: "button", dataset: { control: "promote" }, onclick: () => this.promote(model) }, "Promote canary"),
        el("button", { type: "button", class: "danger", dataset: { control: "rollback" }, onclick: () => this.rollback(model) }, "Roll back canary"),
        weight));
  }

  update(card, view, now) {
    const { policy, state } = view.doc;
    const steps = view.doc.rollout ? view.doc.rollout.steps.length : 0;
    const phase = !view.doc.rollout ? "weights by hand"
      : state.phase === "rolling" ? `rolling · step ${Math.max(0, state.step + 1)} of ${steps}` : state.phase.replace("_", " ");
    const badge = card.querySelector('[data-role="phase"]');
    setText(badge, phase);
    badge.className = `badge phase-${view.doc.rollout ? state.phase : "manual"}`;
    const bar = card.querySelector('[data-role="shares"]');
    bar.children[0].style.width = `${(1 - policy.canary_weight) * 100}%`;
    bar.children[1].style.width = `${policy.canary_weight * 100}%`;
    bar.title = `primary ${fmt.pct(1 - policy.canary_weight)}, canary ${fmt.pct(policy.canary_weight)}`;
    syncRows(card.querySelector("tbody"), view.versions, (v) => v.version,
      () => el("tr", {}, ...Array.from({ length: 8 }, () => el("td"))),
      (row, v) => {
        const agreement = v.agreement === null ? "–" : `${Number(v.agreement.toFixed(3))} (${v.agreement_samples})`;
        const share = v.role === "shadow" ? `${fmt.pct(v.share)} mirrored` : fmt.pct(v.share);
        const errors = v.requests ? `${fmt.pct(v.error_rate)} (${v.failures})` : "–";
        const cells = [v.version, v.role, share, v.requests, errors, fmt.ms(v.p99_ms), agreement, BREAKER_WORDS[v.breaker.status]];
        cells.forEach((text, i) => setText(row.children[i], text));
        row.dataset.role = v.role;
        row.dataset.breaker = v.breaker.status;
        const cell = row.children[7];
        cell.className = `breaker breaker-${v.breaker.status}`;
        cell.title = v.breaker.status === "open" ? `${v.breaker.reason}; retry after ${fmt.num(v.breaker.retry_after_s, 0)} s` : v.breaker.reason;
      });
    const canary = policy.canary !== null;
    card.querySelector('[data-control="promote"]').disabled = !canary;
    card.querySelector('[data-control="rollback"]').disabled = !canary;
    card.querySelector('[data-control="set-weight"]').disabled = !canary;
    card.querySelector('input[name="weight"]').placeholder = fmt.num(policy.canary_weight * 100, 1);
    this.decisions(card, view.decisions, now);
  }

  decisions(card, entries, now) {
    const line = card.querySelector('[data-role="timeline"]');
    line.replaceChildren(...entries.filter((d) => now - d.at <= TIMELINE_S).map((d) => el("span", {
      class: `tick ${d.action === "hold" ? "" : "changed"} tick-${d.action}`,
      style: `left: ${Math.max(0, Math.min(100, 100 - ((now - d.at) / TIMELINE_S) * 100))}%`,
      title: `${fmt.time(d.at)} ${ACTION_WORDS[d.action] || d.action}: ${d.reason}`,
    })));
    const list = card.querySelector('[data-role="decisions"]');
    const signature = JSON.stringify(entries.map((d) => [d.at, d.action, d.reason]));
    if (list.dataset.signature === signature) return;
    list.dataset.signature = signature;
    if (!entries.length) {
      list.replaceChildren(el("li", { class: "empty" }, "No decisions yet: the controller records each step, rollback and breaker change."));
      return;
    }
    list.replaceChildren(...entries.map((d) => el("li", { dataset: { action: d.action, by: d.by } },
      el("time", {}, fmt.time(d.at)),
      el("b", {}, ACTION_WORDS[d.action] || d.action), ` ${d.reason}`,
      d.by !== "controller" ? el("span", { class: "muted" }, ` · by ${d.by}`) : "")));
  }

  viewOf(model) {
    return this.views.find((v) => v.model === model);
  }

  promote(model) {
    const view = this.viewOf(model);
    const { primary, canary, canary_weight: weight } = view.doc.policy;
    this.act(`Promote ${model}'s canary`,
      `Version ${canary} (now at ${fmt.pct(weight)}) becomes the primary of ${model} at once and answers every request; version ${primary} stops answering.`,
      "Promote", "POST", pathOf(model, "promote"), undefined, (v) => `${model}: version ${v.doc.policy.primary} promoted to primary`);
  }

  rollback(model) {
    const view = this.viewOf(model);
    const { primary, canary, canary_weight: weight } = view.doc.policy;
    this.act(`Roll back ${model}'s canary`,
      `Version ${canary} goes from ${fmt.pct(weight)} to 0 % at once; version ${primary} answers every request and the controller leaves it there.`,
      "Roll back", "POST", pathOf(model, "rollback"), undefined, () => `${model}: canary ${canary} rolled back to 0 %`);
  }

  setWeight(event, model) {
    event.preventDefault();
    const form = event.target;
    const percent = Number(form.weight.value);
    if (!(percent >= 0 && percent <= 100)) return;
    const view = this.viewOf(model);
    const policy = { ...view.doc.policy, canary_weight: percent / 100 };
    this.act(`Set ${model}'s canary weight to ${fmt.num(percent, 2)} %`,
      `Version ${policy.canary} answers ${fmt.num(percent, 2)} % of ${model}'s requests. Automatic rollout stops for this model: the weight stays where you set it until the next change.`,
      "Set weight", "PUT", pathOf(model, "traffic"), { policy, rollout: null, breaker: view.doc.breaker }, () => {
        form.reset();
        return `${model}: canary ${policy.canary} at ${fmt.num(percent, 2)} %`;
      });
  }
}
