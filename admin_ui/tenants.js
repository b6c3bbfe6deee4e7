// Tenants: create one, disable or enable it. A disabled tenant's keys are refused.

import { api } from "./api.js";
import { loadTenants } from "./tenants-store.js";
import { acting, badge, byId, emptyRow, formatDate, h, showAlert, submitting } from "./ui.js";

const form = byId("tenant-form");
const formError = byId("tenant-form-error");
const rows = byId("tenant-rows");

form.addEventListener("submit", (event) => {
  event.preventDefault();
  submitting(form, formError, async () => {
    await api("POST", "/tenants", { name: form.elements.name.value.trim() });
    form.reset();
    await render();
  });
});

export async function enter() {
  try {
    await render();
  } catch (error) {
    showAlert(error);
  }
}

async function render() {
  const tenants = await loadTenants();
  rows.replaceChildren(...tenants.map(row));
  if (!tenants.length) rows.append(emptyRow(5, "No tenants yet."));
}

function row(tenant) {
  return h(
    "tr",
    {},
    h("td", {}, tenant.name),
    h("td", { class: "mono" }, tenant.id),
    h("td", {}, tenant.disabled ? badge("disabled") : badge("active")),
    h("td", {}, formatDate(tenant.created_at)),
    h("td", { class: "actions" }, toggle(tenant)),
  );
}

function toggle(tenant) {
  const disable = !tenant.disabled;
  const button = h(
    "button",
    {
      type: "button",
      class: disable ? "danger" : null,
      "aria-label": `${disable ? "Disable" : "Enable"} tenant ${tenant.name}`,
      onclick: () =>
        acting(button, async () => {
          if (disable && !confirm(`Disable ${tenant.name}? Its keys stop working at once.`)) return;
          await api("PATCH", `/tenants/${tenant.id}`, { disabled: disable });
          await render();
        }),
    },
    disable ? "Disable" : "Enable",
  );
  return button;
}
