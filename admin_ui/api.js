// The admin REST API (/admin/v1) and the admin token, kept for this browser tab only.
//
// Every failure becomes an ApiError carrying the server's own message
// ({"error": {"message", "type", "param", "code"}}); a 401 also goes to the handler given to
// onUnauthorized, which brings back the sign-in form.

const TOKEN_KEY = "loraplex-admin-token";
const BASE = "v1"; // relative to the page at /admin/, so a path prefix in front still works

export class ApiError extends Error {
  constructor(status, error) {
    super(error.message || `The server replied with status ${status}.`);
    this.status = status;
    this.param = error.param ?? null;
    this.code = error.code ?? null;
  }
}

// sessionStorage, never localStorage or a cookie: the token leaves with the tab.
export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

let unauthorized = () => {};

export function onUnauthorized(handler) {
  unauthorized = handler;
}

/** A JSON request; resolves to the parsed reply, rejects with an ApiError. */
export async function api(method, path, body, bearer = token.get()) {
  const headers = { Authorization: `Bearer ${bearer}` };
  const init = { method, headers, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let reply;
  try {
    reply = await fetch(BASE + path, init);
  } catch {
    throw unreachable();
  }
  return settle(reply.status, await reply.text());
}

/** A multipart POST through XMLHttpRequest, whose upload events give a progress fraction. */
export function upload(path, formData, onProgress) {
  return new Promise((resolve, reject) => {
    const request = new XMLHttpRequest();
    request.open("POST", BASE + path);
    request.setRequestHeader("Authorization", `Bearer ${token.get()}`);
    request.upload.onprogress = (event) => {
      if (event.lengthComputable) onProgress(event.loaded / event.total);
    };
    request.upload.onload = () => onProgress(1);
    request.onload = () => {
      try {
        resolve(settle(request.status, request.responseText));
      } catch (error) {
        reject(error);
      }
    };
    request.onerror = () => reject(unreachable());
    request.send(formData);
  });
}

function settle(status, text) {
  const body = parseJson(text);
  if (status >= 200 && status < 300) return body;
  const detail = body?.error ?? { message: `The server replied with status ${status}.` };
  const error = new ApiError(status, detail);
  if (status === 401) unauthorized(error);
  throw error;
}

function parseJson(text) {
  try {
    return text ? JSON.parse(text) : null;
  } catch {
    return null; // a proxy's HTML error page, say: the status alone tells what happened
  }
}

function unreachable() {
  return new ApiError(0, { message: "The server could not be reached; is it running?" });
}
