// Typed helpers over leasehold's host functions: each effect takes and
// returns JavaScript values instead of JSON strings, and throws an
// EffectError that says which effect failed and how. Every call is recorded
// in the run's ledger and replayed when the run resumes, so make the same
// calls in the same order every time (see wit/turn.wit).
//
// Shipped with `leasehold new --lang js`; build.sh bundles it with app.js.

import * as host from 'leasehold:turn/host@0.1.0';

export class EffectError extends Error {
  // kind: 'failed' (the provider ran and failed), 'in-doubt' (an unkeyed
  // effect whose segment died: it may or may not have happened) or
  // 'denied' (refused without being performed).
  constructor(effect, kind, message) {
    super(`${effect} ${kind}: ${message}`);
    this.effect = effect;
    this.kind = kind;
    this.detail = message;
  }
}

// Performs effect `name` with a JSON-able request; returns its result.
export function effect(name, request) {
  let result;
  try {
    result = host.effect(name, JSON.stringify(request));
  } catch (e) {
    const error = e !== null && typeof e === 'object' && 'payload' in e ? e.payload : e;
    const kind = error && typeof error.tag === 'string' ? error.tag : 'failed';
    throw new EffectError(name, kind, error && typeof error.val === 'string' ? error.val : String(error));
  }
  return JSON.parse(result);
}

// Appends text to the turn's streamed output.
export function emit(text) {
  host.emit(text);
}

// Suspends the run until someone delivers input, and returns it.
export function waitInput(prompt) {
  return host.waitInput(prompt);
}

// Writes a line to the host's log (not recorded).
export function log(message) {
  host.log(2, message);
}

export const http = {
  // GET url. Keyed: a re-issue after a crash carries the same Idempotency-Key.
  get(url) {
    const r = effect('http', { method: 'GET', url });
    return { status: r.status, body: r.body };
  },
  // POST url with a JSON body. Keyed, as get.
  post(url, body) {
    const r = effect('http', { method: 'POST', url, body });
    return { status: r.status, body: r.body };
  },
};

export const kv = {
  // The value stored under key in this plugin's namespace, or null.
  get(key) {
    return effect('kv.get', { key });
  },
  // Stores value under key, exactly once however often the run dies.
  put(key, value) {
    effect('kv.put', { key, value });
  },
};

export const model = {
  // Asks the host's model ([{role, content}, ...]); returns its answer,
  // which also streams into the output.
  chat(messages) {
    return effect('model.chat', { messages }).content;
  },
};
