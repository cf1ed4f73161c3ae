// uPlot time-series charts over the 15-minute ring: one set per model.
/* global uPlot */

export const RING_S = 15 * 60;

const CHARTS = [
  { key: "lag", title: "Queue lag (requests waiting)", series: [["lag", "lag", "--c1"]] },
  {
    key: "rates",
    title: "Rates (/s)",
    series: [
      ["arrival_rate", "arrival", "--c1"],
      ["throughput_per_s", "throughput", "--c3"],
      ["error_rate", "errors", "--c2"],
      ["dead_letter_rate", "dead letters", "--c4"],
    ],
  },
  {
    key: "latency",
    title: "Latency (ms)",
    series: [
      ["latency_p50_ms", "p50", "--c1"],
      ["latency_p99_ms", "p99", "--c2"],
    ],
  },
  {
    key: "replicas",
    title: "Replicas",
    series: [
      ["current_replicas", "current", "--c3"],
      ["desired_replicas", "desired", "--c5"],
    ],
  },
];

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function columns(samples, spec) {
  const xs = samples.map((s) => s.at);
  return [xs, ...spec.series.map(([field]) => samples.map((s) => (s[field] ?? null)))];
}

function options(spec, width) {
  const fg = cssVar("--muted");
  const grid = cssVar("--border");
  const axis = { stroke: fg, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } };
  const clock = { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false };
  const timeAxis = {
    ...axis,
    space: 70,
    values: (u, splits) => splits.map((t) => new Date(t * 1000).toLocaleTimeString([], clock)),
  };
  return {
    width,
    height: 150,
    cursor: { drag: { x: false, y: false } },
    legend: { live: false },
    scales: { x: { time: true }, y: { range: (u, min, max) => [Math.min(0, min ?? 0), Math.max(1, max ?? 1)] } },
    axes: [timeAxis, { ...axis, size: 46 }],
    series: [
      {},
      ...spec.series.map(([, label, color]) => ({ label, stroke: cssVar(color), width: 2, spanGaps: false })),
    ],
  };
}

// The charts of one model, drawn into `host` (an element with one .chart[data-chart=key] per chart).
export class ModelCharts {
  constructor(host) {
    this.host = host;
    this.plots = {};
    this.samples = [];
  }

  width() {
    const one = this.host.querySelector(".chart");
    return Math.max(260, (one ? one.clientWidth : 320) - 4);
  }

  build() {
    for (const plot of Object.values(this.plots)) plot.destroy();
    this.plots = {};
    const width = this.width();
    for (const spec of CHARTS) {
      const slot = this.host.querySelector(`.chart[data-chart="${spec.key}"] .plot`);
      this.plots[spec.key] = new uPlot(options(spec, width), columns(this.samples, spec), slot);
    }
  }

  update(samples) {
    this.samples = samples;
    if (!Object.keys(this.plots).length) this.build();
    for (const spec of CHARTS) this.plots[spec.key].setData(columns(samples, spec));
  }

  resize() {
    const width = this.width();
    for (const plot of Object.values(this.plots)) plot.setSize({ width, height: 150 });
  }

  // What the lag chart holds: [times, values], for tests and for screen readers' summaries.
  data(key) {
    return this.plots[key] ? this.plots[key].data : null;
  }
}

export const CHART_SPECS = CHARTS;
