// {{name}}: a leasehold turn. Input: {"url": "http://..."}. It fetches the
// URL (http), counts its visits in kv, streams a line (emit) and returns a
// summary. Every effect goes through the typed helpers in helpers.js; each
// is recorded, and replayed when the run resumes, so the turn must make the
// same calls in the same order every time. Returning a string completes the
// run; throwing fails it with the error's message and stack.

import { emit, http, kv } from './helpers.js';

export function run(input) {
  try {
    const { url } = JSON.parse(input);
    if (typeof url !== 'string') throw new TypeError('bad input: "url" must be a string');
    const page = http.get(url);
    const visits = (kv.get('visits') ?? 0) + 1;
    kv.put('visits', visits);
    emit(`fetched ${url}\n`);
    return `fetched ${new TextEncoder().encode(page.body).length} bytes (HTTP ${page.status}); visit ${visits}`;
  } catch (e) {
    // A thrown string is the run's error: keep the stack with it.
    throw e instanceof Error ? `${e.name}: ${e.message}\n${e.stack}` : String(e);
  }
}
