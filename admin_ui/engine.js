// The live engine view: requests running and waiting, tokens per second, the page pool split
// between KV cache and adapters, and the resident adapters; polled every 2 seconds while shown.
//
// The engine reports num_generated_tokens since it started, so tokens per second is the
// difference between two polls over the time between them.

import { api } from "./api.js";
import { TimeChart } from "./chart.js";
import { byId, emptyRow, formatDecimal, formatNumber, h, showError } from "./ui.js";

const POLL_MS = 2000;
const HISTORY_SECONDS = 300;

const numbers = {
  running: byId("engine-running"),
  waiting: byId("engine-waiting"),
  rate: byId("engine-rate"),
  generated: byId("engine-generated"),
};
const pool = {
  kvBar: byId("pool-bar-kv"),
  cachedBar: byId("pool-bar-cached"),
  adapterBar: byId("pool-bar-adapters"),
  kv: byId("pool-kv"),
  cached: byId("pool-cached"),
  adapters: byId("pool-adapters"),
  free: byId("pool-free"),
  total: byId("pool-total"),
};
const errorRegion = byId("engine-error");
const chart = new TimeChart(byId("engine-chart"));

let timer = null;
let visit = 0; // counts view visits; a poll of an earlier visit stops instead of going on
let previous = null; // {tokens, at}: the last poll, for the rate
let history = { times: [], rates: [], running: [] };
let adapterNames = new Map(); // adapter id -> name, for the resident table

export function enter() {
  visit += 1;
  previous = null;
  history = { times: [], rates: [], running: [] };
  poll(visit);
}

export function leave() {
  visit += 1;
  clearTimeout(timer);
}

async function poll(current) {
  try {
    const report = await api("GET", "/engine");
    await learnNames(report.pool.resident);
    if (current !== visit) return;
    render(report);
    showError(errorRegion, null);
  } catch (error) {
    if (current === visit) showError(errorRegion, error); // and poll again: it may recover
  }
  // Leaving the view (signing out too) starts another visit, which ends this loop.
  if (current === visit) timer = setTimeout(() => poll(current), POLL_MS);
}

// Resident adapters are shown by name: the list is fetched again only for an unknown id.
async function learnNames(resident) {
  const ids = resident.flatMap((entry) => entry.adapter_ids);
  if (ids.every((id) => adapterNames.has(id))) return;
  const adapters = (await api("GET", "/adapters")).data;
  adapterNames = new Map(adapters.map((adapter) => [adapter.id, adapter.name]));
}

function render(report) {
  const { stats } = report;
  const at = performance.now();
  const rate = tokensPerSecond(stats.num_generated_tokens, at);
  previous = { tokens: stats.num_generated_tokens, at };

  numbers.running.textContent = formatNumber(stats.num_running_requests);
  numbers.waiting.textContent = formatNumber(stats.num_waiting_requests);
  numbers.rate.textContent = rate == null ? "–" : formatDecimal(rate);
  numbers.generated.textContent = formatNumber(stats.num_generated_tokens);
  renderPool(report.pool);
  renderHistory(rate ?? 0, stats.num_running_requests);
  renderResident(report.pool.resident);
  renderModel(report);
  byId("engine-updated").textContent = new Date().toLocaleTimeString();
}

function tokensPerSecond(tokens, at) {
  if (!previous || tokens < previous.tokens) return null; // first poll, or a restarted server
  return ((tokens - previous.tokens) * 1000) / (at - previous.at);
}

// Cached prefixes: KV pages kept for reuse, given back whenever something needs the room.
function renderPool({ num_pages, free_pages, kv_pages, cached_pages, adapter_pages }) {
  sizeBar(pool.kvBar, kv_pages, num_pages);
  sizeBar(pool.cachedBar, cached_pages, num_pages);
  sizeBar(pool.adapterBar, adapter_pages, num_pages);
  pool.kv.textContent = formatNumber(kv_pages);
  pool.cached.textContent = formatNumber(cached_pages);
  pool.adapters.textContent = formatNumber(adapter_pages);
  pool.free.textContent = formatNumber(free_pages);
  pool.total.textContent = formatNumber(num_pages);
}

function sizeBar(bar, pages, numPages) {
  bar.style.width = `${numPages ? (100 * pages) / numPages : 0}%`;
  bar.style.minWidth = pages > 0 ? "2px" : "0"; // a few pages among thousands still show
}

function renderHistory(rate, running) {
  const now = Date.now() / 1000;
  history.times.push(now);
  history.rates.push(rate);
  history.running.push(running);
  while (history.times[0] < now - HISTORY_SECONDS) {
    for (const values of Object.values(history)) values.shift();
  }
  const lines = [
    { label: "tokens/s", values: history.rates },
    { label: "running requests", values: history.running, scale: "requests" },
  ];
  chart.show(history.times, lines, [now - HISTORY_SECONDS, now]);
}

function renderResident(resident) {
  const rows = byId("resident-rows");
  rows.replaceChildren(
    ...resident.map((entry) =>
      h(
        "tr",
        {},
        h("td", {}, entry.adapter_ids.map((id) => adapterNames.get(id) ?? id).join(", ")),
        h("td", { class: "number" }, entry.rank),
        h("td", { class: "number" }, formatNumber(entry.pages)),
        h("td", {}, entry.pinned ? "yes" : "no"),
        h("td", { class: "number" }, entry.running_requests),
      ),
    ),
  );
  if (!resident.length) rows.append(emptyRow(5, "No adapter is in the pool."));
}

function renderModel({ model, info }) {
  const facts = [
    ["Served as", model],
    ["Architecture", info.architecture],
    ["Data type", info.dtype],
    ["Context length", formatNumber(info.max_model_len)],
    ["Page size", `${info.page_size} tokens`],
    ["Largest adapter rank", formatNumber(info.max_lora_rank)],
  ];
  byId("engine-model").replaceChildren(
    ...facts.map(([term, value]) => h("div", {}, h("dt", {}, term), h("dd", {}, value))),
  );
}
