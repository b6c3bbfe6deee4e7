// API keys: create one with its limits, see its secret once, list keys by prefix, revoke one.
//
// The secret lives only in the panel's input: it is cleared when the panel is dismissed or the
// view is left, and nothing stores it, so a reload cannot bring it back.

import { api } from "./api.js";
import { loadTenants, tenantName } from "./tenants-store.js";
import {
  acting,
  badge,
  byId,
  emptyRow,
  formatDate,
  formatNumber,
  h,
  showAlert,
  submitting,
} from "./ui.js";

const LIMITS = [
  "requests_per_minute",
  "tokens_per_minute",
  "max_concurrent",
  "batch_tokens_per_day",
];

const form = byId("key-form");
const formError = byId("key-form-error");
const filter = byId("key-filter");
const rows = byId("key-rows");
const secret = {
  panel: byId("key-secret"),
  value: byId("key-secret-value"),
  status: byId("key-secret-status"),
};

form.addEventListener("submit", (event) => {
  event.preventDefault();
  submitting(form, formError, async () => {
    const tenantId = form.elements.tenant_id.value;
    const created = await api("POST", `/tenants/${tenantId}/keys`, keyBody());
    showSecret(created.key);
    form.reset();
    form.elements.tenant_id.value = tenantId; // the next key is likely for the same tenant
    await renderKeys();
  });
});

filter.addEventListener("change", () => renderKeys().catch(showAlert));
byId("key-secret-copy").addEventListener("click", copySecret);
byId("key-secret-done").addEventListener("click", hideSecret);

export async function enter() {
  try {
    await loadTenants();
    await renderKeys();
  } catch (error) {
    showAlert(error);
  }
}

export function leave() {
  hideSecret();
}

function keyBody() {
  const body = {
    name: form.elements.name.value.trim(),
    service_tier: form.elements.service_tier.value,
  };
  for (const limit of LIMITS) {
    const value = form.elements[limit].value;
    if (value !== "") body[limit] = Number(value);
  }
  return body;
}

// -- the secret, shown once -----------------------------------------------------------------

function showSecret(key) {
  secret.value.value = key;
  secret.status.textContent = "";
  secret.panel.hidden = false;
  secret.value.focus();
  secret.value.select();
}

function hideSecret() {
  secret.value.value = "";
  secret.status.textContent = "";
  secret.panel.hidden = true;
}

async function copySecret() {
  try {
    await navigator.clipboard.writeText(secret.value.value);
    secret.status.textContent = "Copied to the clipboard.";
  } catch {
    // No clipboard access (a page served over plain http from another host, say).
    secret.value.select();
    secret.status.textContent =
      "The browser refused to copy: the key is selected, copy it yourself.";
  }
}

// -- the list -------------------------------------------------------------------------------

async function renderKeys() {
  const query = filter.value ? `?tenant_id=${encodeURIComponent(filter.value)}` : "";
  const keys = (await api("GET", `/keys${query}`)).data;
  rows.replaceChildren(...keys.map(row));
  if (!keys.length) rows.append(emptyRow(7, "No keys yet."));
}

function row(key) {
  return h(
    "tr",
    {},
    h("td", { class: "mono prefix" }, `${key.prefix}…`),
    h("td", {}, key.name),
    h("td", {}, tenantName(key.tenant_id)),
    h("td", {}, limits(key)),
    h("td", {}, formatDate(key.created_at)),
    h("td", {}, key.revoked ? badge("revoked") : badge("active")),
    h("td", { class: "actions" }, key.revoked ? null : revokeButton(key)),
  );
}

function limits(key) {
  const parts = [
    key.requests_per_minute && `${formatNumber(key.requests_per_minute)} requests/min`,
    key.tokens_per_minute && `${formatNumber(key.tokens_per_minute)} tokens/min`,
    key.max_concurrent && `${formatNumber(key.max_concurrent)} at once`,
    key.batch_tokens_per_day && `${formatNumber(key.batch_tokens_per_day)} batch tokens/day`,
    key.service_tier === "batch" && "batch tier",
  ].filter(Boolean);
  return parts.length ? parts.join(", ") : "none";
}

function revokeButton(key) {
  const button = h(
    "button",
    {
      type: "button",
      class: "danger",
      "aria-label": `Revoke key ${key.prefix}`,
      onclick: () =>
        acting(button, async () => {
          if (!confirm(`Revoke ${key.prefix}…? Requests with it are refused at once.`)) return;
          await api("DELETE", `/keys/${key.id}`);
          await renderKeys();
        }),
    },
    "Revoke",
  );
  return button;
}
