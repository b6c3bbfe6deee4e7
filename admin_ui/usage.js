// Usage per tenant or per adapter over the last hour or day: a chart of tokens (or requests)
// per time bucket, and the totals.

import { api } from "./api.js";
import { TimeChart } from "./chart.js";
import { loadTenants, tenantName } from "./tenants-store.js";
import { byId, emptyRow, formatNumber, h, showError } from "./ui.js";

const MAX_LINES = 7; // more groups than this are summed into one "others" line

const form = byId("usage-form");
const errorRegion = byId("usage-error");
const chartBox = byId("usage-chart");
const chart = new TimeChart(chartBox);

form.addEventListener("change", () => render());
form.addEventListener("submit", (event) => {
  event.preventDefault();
  render();
});

export function enter() {
  return render();
}

async function render() {
  const fields = form.elements;
  const query = `?window=${fields.window.value}&group_by=${fields.group_by.value}`;
  try {
    const [report, nameOf] = await Promise.all([
      api("GET", `/usage${query}`),
      namer(fields.group_by.value),
    ]);
    showError(errorRegion, null);
    drawChart(report, nameOf, fields.metric.value);
    fillTotals(report, nameOf);
  } catch (error) {
    showError(errorRegion, error);
  }
}

/** A function naming a group id, from the current tenants or adapters. */
async function namer(groupBy) {
  if (groupBy === "tenant") {
    await loadTenants();
    return tenantName;
  }
  const adapters = (await api("GET", "/adapters")).data;
  const names = new Map(adapters.map((adapter) => [adapter.id, adapter.name]));
  return (id) => (id == null ? "base model" : (names.get(id) ?? `deleted adapter ${id}`));
}

function drawChart(report, nameOf, metric) {
  const empty = report.series.length === 0;
  byId("usage-empty").hidden = !empty;
  chartBox.hidden = empty;
  if (empty) return;

  const step = report.bucket_seconds;
  const first = Math.floor(report.since / step) * step;
  const now = Date.now() / 1000;
  const times = [];
  for (let at = first; at <= now; at += step) times.push(at);

  const byGroup = new Map(); // group id -> values per bucket
  for (const point of report.series) {
    if (!byGroup.has(point.id)) byGroup.set(point.id, new Array(times.length).fill(0));
    const bucket = Math.round((point.at - first) / step);
    if (bucket >= 0 && bucket < times.length) byGroup.get(point.id)[bucket] += point[metric];
  }
  chart.show(times, topLines(byGroup, nameOf), [report.since, now]);
}

function topLines(byGroup, nameOf) {
  const total = (values) => values.reduce((sum, value) => sum + value, 0);
  const groups = [...byGroup].sort((a, b) => total(b[1]) - total(a[1]));
  const lines = groups.slice(0, MAX_LINES).map(([id, values]) => ({ label: nameOf(id), values }));
  const rest = groups.slice(MAX_LINES);
  if (rest.length) {
    const values = rest[0][1].map((_, i) => rest.reduce((sum, [, other]) => sum + other[i], 0));
    lines.push({ label: `${rest.length} others`, values });
  }
  return lines;
}

function fillTotals(report, nameOf) {
  const grouping = report.group_by === "tenant" ? "Tenant" : "Adapter";
  byId("usage-group-heading").textContent = grouping;
  byId("usage-caption").textContent = `Totals per ${grouping.toLowerCase()}`;
  const tokens = (row) => row.prompt_tokens + row.completion_tokens;
  const totals = [...report.totals].sort((a, b) => tokens(b) - tokens(a));
  const rows = byId("usage-rows");
  rows.replaceChildren(
    ...totals.map((row) =>
      h(
        "tr",
        {},
        h("td", {}, nameOf(row.id)),
        h("td", { class: "number" }, formatNumber(row.requests)),
        h("td", { class: "number" }, formatNumber(row.prompt_tokens)),
        h("td", { class: "number" }, formatNumber(row.completion_tokens)),
        h("td", { class: "number" }, formatNumber(row.errors)),
      ),
    ),
  );
  if (!totals.length) rows.append(emptyRow(5, "No requests in this window."));
}
