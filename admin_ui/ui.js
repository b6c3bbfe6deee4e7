// Small DOM helpers shared by the views: building elements, formatting numbers and times,
// and showing errors. Text always goes in as text (never as HTML), so names from the API
// cannot inject markup.

export const byId = (id) => document.getElementById(id);

/** h("button", {type: "button", onclick: f}, "Pin") -> <button type="button">Pin</button> */
export function h(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value == null || value === false) continue;
    if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else element.setAttribute(name, value === true ? "" : value);
  }
  element.append(...children.flat().filter((child) => child != null));
  return element;
}

/** A table row spanning every column, for "nothing here yet". */
export function emptyRow(columns, text) {
  return h("tr", {}, h("td", { colspan: columns, class: "empty" }, text));
}

export function badge(text, kind = text) {
  return h("span", { class: `badge badge-${kind}` }, text);
}

const numbers = new Intl.NumberFormat();
const decimals = new Intl.NumberFormat(undefined, { maximumFractionDigits: 1 });

export const formatNumber = (value) => numbers.format(value);
export const formatDecimal = (value) => decimals.format(value);

export function formatDate(seconds) {
  return new Date(seconds * 1000).toLocaleString(undefined, {
    dateStyle: "medium",
    timeStyle: "short",
  });
}

export function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${formatDecimal(value)} ${units[unit]}`;
}

// -- errors ---------------------------------------------------------------------------------

/** Show an error (or hide the region when `error` is null) in a role="alert" element. */
export function showError(region, error) {
  region.textContent = error ? error.message : "";
  region.hidden = !error;
}

/** The page-wide alert, for failures that belong to no form (a list that did not load...). */
export function showAlert(error) {
  if (error.status === 401) return; // the sign-in form shows it
  showError(byId("alert-text"), error);
  byId("alert").hidden = false;
}

export function hideAlert() {
  byId("alert").hidden = true;
}

/**
 * Run a form's submission: the submit button is disabled meanwhile, an earlier error is cleared,
 * and a failure is shown next to the form, the field it names marked invalid.
 */
export async function submitting(form, errorRegion, work) {
  const button = form.querySelector("button[type=submit]");
  button.disabled = true;
  showError(errorRegion, null);
  for (const field of form.querySelectorAll("[aria-invalid]")) {
    field.removeAttribute("aria-invalid");
  }
  try {
    await work();
  } catch (error) {
    showError(errorRegion, error);
    form.elements.namedItem(error.param ?? "")?.setAttribute("aria-invalid", "true");
  } finally {
    button.disabled = false;
  }
}

/** Run an action from a table button; a failure goes to the page-wide alert. */
export async function acting(button, work) {
  button.disabled = true;
  try {
    await work();
  } catch (error) {
    showAlert(error);
  } finally {
    button.disabled = false;
  }
}
