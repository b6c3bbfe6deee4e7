// The admin page: sign-in with the admin token, then one view at a time chosen by the URL's
// hash (#tenants, #keys, #adapters, #engine, #usage). Each view module has enter() and may
// have leave(); a view is shown before it enters, so its charts can measure their width.

import * as adapters from "./adapters.js";
import { api, onUnauthorized, token } from "./api.js";
import * as engine from "./engine.js";
import * as keys from "./keys.js";
import * as tenants from "./tenants.js";
import { byId, hideAlert, showError } from "./ui.js";
import * as usage from "./usage.js";

const VIEWS = { tenants, keys, adapters, engine, usage };
const FIRST_VIEW = "tenants";

const signInSection = byId("sign-in");
const signInForm = byId("sign-in-form");
const signInError = byId("sign-in-error");
const nav = byId("views");
const signOutButton = byId("sign-out");

let current = null; // the name of the view shown

signInForm.addEventListener("submit", async (event) => {
  event.preventDefault();
  const candidate = signInForm.elements.token.value.trim();
  const button = signInForm.querySelector("button[type=submit]");
  button.disabled = true;
  showError(signInError, null);
  try {
    await api("GET", "/tenants", undefined, candidate); // any admin call checks the token
    token.set(candidate);
    signInForm.reset();
    showApp();
  } catch (error) {
    showError(signInError, error);
  } finally {
    button.disabled = false;
  }
});

signOutButton.addEventListener("click", () => signOut(null));
byId("alert-close").addEventListener("click", hideAlert);
onUnauthorized((error) => signOut(error));
window.addEventListener("hashchange", () => {
  if (token.get()) route({ focus: true });
});

function showApp() {
  signInSection.hidden = true;
  nav.hidden = false;
  signOutButton.hidden = false;
  route({ focus: false });
}

/** Back to the sign-in form, with the reason (a 401's message) when there is one. */
function signOut(error) {
  token.clear();
  leaveView();
  hideAlert();
  nav.hidden = true;
  signOutButton.hidden = true;
  signInSection.hidden = false;
  showError(signInError, error);
  signInForm.elements.token.focus();
}

function route({ focus }) {
  const wanted = location.hash.slice(1);
  const name = Object.hasOwn(VIEWS, wanted) ? wanted : FIRST_VIEW;
  leaveView();
  hideAlert();
  current = name;
  const section = byId(`view-${name}`);
  section.hidden = false;
  for (const link of nav.querySelectorAll("a")) {
    if (link.hash === `#${name}`) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  document.title = `${section.querySelector("h2").textContent} · loraplex admin`;
  if (focus) section.querySelector("h2").focus();
  VIEWS[name].enter();
}

function leaveView() {
  if (current === null) return;
  VIEWS[current].leave?.();
  byId(`view-${current}`).hidden = true;
  current = null;
}

if (token.get()) showApp();
else signOut(null);
