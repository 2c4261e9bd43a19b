// Typed helpers over leasehold's host functions: each effect takes and
// returns JavaScript values instead of JSON strings, and throws an
// EffectError that says which effect failed and how. Every call is recorded
// in the run's ledger and replayed when the run resumes, so make the same
// calls in the same order every time (see wit/turn.wit).
//
// Shipped with `leasehold new --lang js`; build.sh bundles it with app.js.

import * as host from 'leasehold:turn/host@0.2.0';
import * as wit from 'leasehold:turn/children@0.2.0';
import * as waitsWit from 'leasehold:turn/waits@0.2.0';

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

// Calls host function `f`, turning its error into an EffectError for `name`.
function call(name, f) {
  try {
    return f();
  } catch (e) {
    const error = e !== null && typeof e === 'object' && 'payload' in e ? e.payload : e;
    const kind = error && typeof error.tag === 'string' ? error.tag : 'failed';
    throw new EffectError(name, kind, error && typeof error.val === 'string' ? error.val : String(error));
  }
}

// Performs effect `name` with a JSON-able request; returns its result.
export function effect(name, request) {
  return JSON.parse(call(name, () => host.effect(name, JSON.stringify(request))));
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

// Child runs (docs/plugins.md, "Child runs"): spawn runs of other plugins
// (granted by the plugin's spawn_allow) and wait for them.
export const children = {
  // Spawns a run of plugin with a JSON-able input as a child of this run;
  // returns its id (a BigInt). options: {priority, concurrency_key,
  // max_attempts, detached}.
  spawn(plugin, input, options = {}) {
    return call('spawn', () => wit.spawn(plugin, JSON.stringify(input), JSON.stringify(options)));
  },
  // Waits for every child in ids to end (or timeoutMs to pass); returns
  // their outcomes in order: {status: 'completed', output},
  // {status: 'failed' | 'aborted', error}, {status: 'cancelled'} or
  // {status: 'pending'}.
  awaitAll(ids, timeoutMs) {
    return wait(ids, 'all', timeoutMs);
  },
  // Waits for the first child in ids to end; the others are pending.
  awaitAny(ids, timeoutMs) {
    return wait(ids, 'any', timeoutMs);
  },
};

function wait(ids, mode, timeoutMs) {
  const timeout = timeoutMs === undefined || timeoutMs === null ? undefined : BigInt(timeoutMs);
  const results = call('await-children', () => wit.awaitChildren(ids.map(BigInt), mode, timeout));
  return results.map(({ outcome }) => {
    switch (outcome.tag) {
      case 'completed':
        return { status: 'completed', output: outcome.val };
      case 'failed':
      case 'aborted':
        return { status: outcome.tag, error: outcome.val };
      default:
        return { status: outcome.tag };
    }
  });
}

// Named waits (docs/plugins.md, "Named waits"): input delivered to this run
// under a name, taken when the turn gets there.
export const waits = {
  // Waits for input delivered under name (it may have arrived already)
  // and returns it; undefined once timeoutMs has passed.
  waitFor(name, prompt, timeoutMs) {
    const timeout = timeoutMs === undefined || timeoutMs === null ? undefined : BigInt(timeoutMs);
    const got = waitsWit.waitFor(name, prompt, timeout);
    return got === null ? undefined : got;
  },
  // A one-use link that delivers input to the wait on name without the
  // API token (POST <link> with {input}).
  answerLink(name) {
    return call('answer-link', () => waitsWit.answerLink(name));
  },
};
