// Adapters: upload the two files or register a directory on the server, see where each adapter
// is held (registered, host-cached, resident, pinned), pin, unpin, delete.

import { api, upload } from "./api.js";
import { loadTenants, tenantName } from "./tenants-store.js";
import { acting, badge, byId, emptyRow, formatBytes, h, showAlert, submitting } from "./ui.js";

const uploadForm = byId("upload-form");
const pathForm = byId("path-form");
const rows = byId("adapter-rows");
const progress = {
  row: byId("upload-progress-row"),
  bar: byId("upload-progress"),
  percent: byId("upload-percent"),
};

uploadForm.addEventListener("submit", (event) => {
  event.preventDefault();
  submitting(uploadForm, byId("upload-form-error"), async () => {
    const fields = uploadForm.elements;
    const body = new FormData();
    body.append("name", fields.name.value.trim());
    if (fields.tenant_id.value) body.append("tenant_id", fields.tenant_id.value);
    body.append("adapter_config", fields.adapter_config.files[0]);
    body.append("adapter_model", fields.adapter_model.files[0]);
    showProgress(0);
    await upload("/adapters/upload", body, showProgress);
    uploadForm.reset();
    await renderAdapters();
  });
});

pathForm.addEventListener("submit", (event) => {
  event.preventDefault();
  submitting(pathForm, byId("path-form-error"), async () => {
    const fields = pathForm.elements;
    await api("POST", "/adapters", {
      name: fields.name.value.trim(),
      path: fields.path.value.trim(),
      tenant_id: fields.tenant_id.value || null,
    });
    pathForm.reset();
    await renderAdapters();
  });
});

byId("adapters-refresh").addEventListener("click", () => renderAdapters().catch(showAlert));

export async function enter() {
  try {
    await loadTenants();
    await renderAdapters();
  } catch (error) {
    showAlert(error);
  }
}

function showProgress(fraction) {
  const percent = Math.round(fraction * 100);
  progress.row.hidden = false;
  progress.bar.value = percent;
  progress.percent.textContent = `${percent}%`;
}

// -- the list -------------------------------------------------------------------------------

async function renderAdapters() {
  const adapters = (await api("GET", "/adapters")).data;
  rows.replaceChildren(...adapters.map(row));
  if (!adapters.length) rows.append(emptyRow(8, "No adapters yet."));
}

function row(adapter) {
  return h(
    "tr",
    { "data-adapter": adapter.name },
    h("td", {}, adapter.name),
    h("td", {}, adapter.shared ? "shared" : tenantName(adapter.tenant_id)),
    h("td", { class: "number" }, adapter.rank),
    h("td", { class: "modules" }, adapter.target_modules.join(", ")),
    h("td", { class: "number" }, formatBytes(adapter.size_bytes)),
    h("td", {}, badge(adapter.status)),
    h("td", { class: "number" }, adapter.running_requests),
    h("td", { class: "actions" }, pinButton(adapter), deleteButton(adapter)),
  );
}

function pinButton(adapter) {
  const action = adapter.pinned ? "unpin" : "pin";
  const label = adapter.pinned ? "Unpin" : "Pin";
  const button = h(
    "button",
    {
      type: "button",
      "aria-label": `${label} ${adapter.name}`,
      onclick: () =>
        acting(button, async () => {
          await api("POST", `/adapters/${adapter.id}/${action}`);
          await renderAdapters();
        }),
    },
    label,
  );
  return button;
}

function deleteButton(adapter) {
  const button = h(
    "button",
    {
      type: "button",
      class: "danger",
      "aria-label": `Delete ${adapter.name}`,
      onclick: () =>
        acting(button, async () => {
          const question = `Delete ${adapter.name}? Running requests finish; new ones are refused.`;
          if (!confirm(question)) return;
          await api("DELETE", `/adapters/${adapter.id}`);
          await renderAdapters();
        }),
    },
    "Delete",
  );
  return button;
}
