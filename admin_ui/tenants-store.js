// The tenant list that several views share: the tenants table, the tenant pickers of the key
// and adapter forms (<select data-tenants="...">) and the names shown in place of ids.

import { api } from "./api.js";
import { h } from "./ui.js";

let tenants = [];

// Pickers by their data-tenants attribute: the option before the tenants, and whether disabled
// tenants are offered (not to own something new, yes to filter by).
const PICKERS = {
  choose: { first: "Choose a tenant", placeholder: true, activeOnly: true },
  shared: { first: "Shared (every tenant)", placeholder: false, activeOnly: true },
  all: { first: "All tenants", placeholder: false, activeOnly: false },
};

export async function loadTenants() {
  tenants = (await api("GET", "/tenants")).data;
  for (const select of document.querySelectorAll("select[data-tenants]")) fillPicker(select);
  return tenants;
}

export function tenantName(id) {
  return tenants.find((tenant) => tenant.id === id)?.name ?? id;
}

function fillPicker(select) {
  const chosen = select.value;
  const picker = PICKERS[select.dataset.tenants];
  const options = tenants
    .filter((tenant) => !(picker.activeOnly && tenant.disabled))
    .map((tenant) => h("option", { value: tenant.id }, tenant.name));
  const first = h("option", { value: "", disabled: picker.placeholder }, picker.first);
  select.replaceChildren(first, ...options);
  select.value = chosen;
  if (select.selectedIndex < 0) select.selectedIndex = 0;
}
