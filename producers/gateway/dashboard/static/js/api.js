// Talking to the gateway: the operator token (sessionStorage), JSON calls, and server-sent events read with
// fetch() + a stream reader so the token travels in the Authorization header, never in a URL.

const TOKEN_KEY = "fleet.operatorToken";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
  get isAuth() {
    return this.status === 401 || this.status === 403;
  }
  describe() {
    return `${this.status} ${this.code}: ${this.message}`;
  }
}

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

function headers(extra) {
  const out = { Accept: "application/json", ...extra };
  const t = token.get();
  if (t) out.Authorization = `Bearer ${t}`;
  return out;
}

async function errorOf(res) {
  let code = res.statusText || "error";
  let message = `the gateway answered ${res.status}`;
  try {
    const body = await res.json();
    const err = body.error || body.detail || {};
    code = err.code || err.type || code;
    message = err.message || (typeof err === "string" ? err : message);
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(res.status, code, message);
}

export async function call(method, path, body) {
  const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  let res;
  try {
    res = await fetch(path, init);
  } catch (exc) {
    throw new ApiError(0, "unreachable", `the gateway did not answer (${exc.message})`);
  }
  if (!res.ok) throw await errorOf(res);
  if (res.status === 204) return null;
  return res.json();
}

export const get = (path) => call("GET", path);

// Read an event stream; onEvent(name, data) for each event (data parsed as JSON). Resolves when the stream ends,
// rejects with ApiError on a refused request or a broken connection.
export async function stream(path, onEvent, signal) {
  let res;
  try {
    res = await fetch(path, { headers: headers({ Accept: "text/event-stream" }), signal, cache: "no-store" });
  } catch (exc) {
    if (signal && signal.aborted) return;
    throw new ApiError(0, "unreachable", `the gateway did not answer (${exc.message})`);
  }
  if (!res.ok) throw await errorOf(res);
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        dispatch(block, onEvent);
      }
    }
  } catch (exc) {
    if (signal && signal.aborted) return;
    throw new ApiError(0, "stream_broken", `the live stream broke (${exc.message})`);
  }
}

function dispatch(block, onEvent) {
  let name = "message";
  const data = [];
  for (const line of block.split(/\r?\n/)) {
    if (line.startsWith(":")) continue; // keep-alive comment
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") name = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return;
  onEvent(name, JSON.parse(data.join("\n")));
}
