// The leasehold dashboard: a hash-routed page over the documented JSON API.
// No framework and no innerHTML: run inputs and outputs are hostile text,
// so every value reaches the DOM through textContent or attributes.

import { chartsSection } from './charts.js';
import { timeline } from './timeline.js';
import { queuesPage } from './queues.js';
import { schedulesPage, schedulePage } from './schedules.js';
import { childrenSection } from './tree.js';

const TOKEN_KEY = 'leasehold-token';
const STATUSES = ['queued', 'running', 'waiting_input', 'waiting_takeover', 'completed', 'failed', 'aborted', 'cancelled'];
const FINISHED = new Set(['completed', 'failed', 'aborted', 'cancelled']);
// `not_before` of a run waiting with no deadline (store::children::FOREVER).
const FOREVER = 253402300799999;
const RETRACT_LINGER_MS = 2000;

let offset = 0;      // database clock minus this browser's clock, from /v1/stats
let current = null;  // the page shown now: { ctl: AbortController, timers: [] }

// ---- small helpers -------------------------------------------------------

// h('a', {href: '#/x', class: 'y'}, 'text', child…): an element. Strings
// become text nodes; null/false children are skipped.
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k === 'text') el.textContent = String(v);
    else if (k === 'value') el.value = v;
    else if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat()) {
    if (c == null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const $ = (sel, root = document) => root.querySelector(sel);
const dbNow = () => Date.now() + offset;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function pad(n, w = 2) { return String(n).padStart(w, '0'); }

// Local time, ISO-like: 2025-12-01 21:13:20.
function fmtTime(ms) {
  if (ms == null) return '—';
  const d = new Date(ms);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function fmtSpan(ms) {
  const s = Math.abs(ms) / 1000;
  if (s < 1) return `${Math.round(Math.abs(ms))} ms`;
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 90 * 60) return `${Math.round(s / 60)} min`;
  if (s < 36 * 3600) return `${Math.round(s / 3600)} h`;
  return `${Math.round(s / 86400)} d`;
}

function fmtRel(ms) {
  if (ms == null) return '—';
  const d = ms - dbNow();
  return d > 0 ? `in ${fmtSpan(d)}` : `${fmtSpan(d)} ago`;
}

// A time that keeps its relative text fresh (the 1 s ticker updates it).
function when(ms, relFirst = true) {
  if (ms == null) return h('span', { class: 'muted', text: '—' });
  return h('time', { class: 'rel', 'data-t': ms, 'data-rel-first': relFirst ? '1' : null, title: fmtTime(ms) },
    relFirst ? fmtRel(ms) : `${fmtTime(ms)} (${fmtRel(ms)})`);
}

// A lease expiry counting down to zero, then up as "expired … ago".
function countdown(ms, id) {
  if (ms == null) return h('span', { id, class: 'muted', text: '—' });
  const el = h('span', { id, class: 'countdown', 'data-expires': ms, title: fmtTime(ms) });
  tickCountdown(el);
  return el;
}

function tickCountdown(el) {
  const left = Number(el.dataset.expires) - dbNow();
  el.textContent = left > 0 ? `${fmtSpan(left)} left` : `expired ${fmtSpan(left)} ago`;
  el.classList.toggle('expired', left <= 0);
}

setInterval(() => {
  for (const el of document.querySelectorAll('.countdown')) tickCountdown(el);
  for (const el of document.querySelectorAll('time.rel')) {
    const t = Number(el.dataset.t);
    el.textContent = el.dataset.relFirst ? fmtRel(t) : `${fmtTime(t)} (${fmtRel(t)})`;
  }
}, 1000);

function badge(status, id) {
  return h('span', { id, class: `badge status-${status}`, text: status });
}

// Digests read `sha256:<hex>`: 12 hex digits tell versions apart.
function short(digest) { return (digest || '').replace(/^sha256:/, '').slice(0, 12); }

function runLink(id) { return h('a', { href: `#/runs/${id}`, text: `#${id}` }); }

function fmtBytes(n) {
  if (n == null) return '—';
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

// JSON text, pretty-printed when it parses; otherwise as given.
function prettyJson(s) {
  if (s == null) return '';
  try { return JSON.stringify(JSON.parse(s), null, 2); } catch { return String(s); }
}

function folded(label, text) {
  if (text == null) return h('span', { class: 'muted', text: '—' });
  return h('details', {}, h('summary', { text: label }), h('pre', { text: prettyJson(text) }));
}

function table(id, headers, rows) {
  return h('table', { id },
    h('thead', {}, h('tr', {}, headers.map((t) => h('th', { text: t })))),
    h('tbody', {}, rows));
}

// ---- the API -------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) {
    super(`${code}: ${message}`);
    this.status = status;
    this.code = code;
  }
}

function token() { return sessionStorage.getItem(TOKEN_KEY) || ''; }

function authHeaders(extra = {}) {
  const t = token();
  return t ? { Authorization: `Bearer ${t}`, ...extra } : extra;
}

// Reads a failed response's `{"error": {code, message}}`, whatever it holds.
async function apiError(res) {
  let code = `http_${res.status}`, message = res.statusText || 'request failed';
  try {
    const body = await res.json();
    if (body && body.error) ({ code = code, message = message } = body.error);
  } catch { /* not JSON: keep the status line */ }
  if (res.status === 401) askForToken(message);
  return new ApiError(res.status, code, message);
}

async function api(path, { method = 'GET', body, signal } = {}) {
  const headers = authHeaders({ Accept: 'application/json' });
  const init = { method, headers, signal };
  // The API answers 415 to a POST without a JSON body.
  if (method !== 'GET') {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body ?? {});
  }
  const res = await fetch(path, init);
  if (!res.ok) throw await apiError(res);
  return res.json();
}

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v != null && v !== '') q.set(k, v);
  const s = q.toString();
  return s ? `?${s}` : '';
}

// The token form, shown once whatever number of calls answered 401.
function askForToken(message) {
  const box = $('#auth');
  if ($('#token', box)) return;
  const input = h('input', { id: 'token', type: 'password', placeholder: 'API token', autocomplete: 'off' });
  const save = () => {
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    box.replaceChildren();
    refreshStats();
    route();
  };
  input.addEventListener('keydown', (e) => { if (e.key === 'Enter') save(); });
  box.replaceChildren(h('div', { class: 'auth' },
    h('label', { for: 'token', text: 'This host wants a token: ' }), input,
    h('button', { type: 'button', id: 'token-save', onclick: save, text: 'Use token' }),
    h('span', { class: 'error', text: message })));
  input.focus();
}

// ---- live counts (every page) --------------------------------------------

let statsLoaded;
const firstStats = new Promise((r) => { statsLoaded = r; });

function buildCounts() {
  $('#counts').replaceChildren(...STATUSES.map((st) =>
    h('a', { class: `count status-${st}`, href: `#/runs?status=${st}`, title: st },
      h('span', { class: 'count-label', text: st.replace('_', ' ') }),
      h('b', { 'data-status': st, text: '…' }))));
}

async function refreshStats() {
  try {
    const stats = await api('/v1/stats');
    offset = stats.now - Date.now();
    for (const st of STATUSES) {
      const el = $(`#counts [data-status="${st}"]`);
      if (el) el.textContent = String(stats.runs?.[st] ?? 0);
    }
    $('#counts').classList.remove('stale');
    $('#counts').title = '';
    statsLoaded();
  } catch (e) {
    $('#counts').classList.add('stale');
    $('#counts').title = e.message;
  }
}

// ---- routing -------------------------------------------------------------

function route() {
  // First load with `/#token=…`: keep the token, drop it from the address.
  if (location.hash.startsWith('#token=')) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(location.hash.slice(7)));
    history.replaceState(null, '', `${location.pathname}${location.search}#/runs`);
  }
  if (current) {
    current.ctl.abort();
    current.timers.forEach(clearInterval);
  }
  const ctl = new AbortController();
  const ctx = { ctl, signal: ctl.signal, timers: [] };
  current = ctx;
  delete document.body.dataset.ready;

  const hash = location.hash.replace(/^#\/?/, '');
  const [path, qs = ''] = hash.split('?');
  const params = new URLSearchParams(qs);
  const parts = path.split('/').filter(Boolean);
  let page = 'runs', render = () => runsPage(ctx, params);
  if (parts[0] === 'runs' && parts[1]) {
    page = 'run';
    render = () => runPage(ctx, Number(parts[1]));
  } else if (parts[0] === 'plugins') {
    page = 'plugins'; render = () => pluginsPage(ctx);
  } else if (parts[0] === 'hosts') {
    page = 'hosts'; render = () => hostsPage(ctx);
  } else if (parts[0] === 'queues') {
    page = 'queues'; render = () => queuesPage(ctx, { h, api, table, when, fmtSpan, actionError });
  } else if (parts[0] === 'schedules' && parts[1]) {
    page = 'schedule'; render = () => schedulePage(ctx, { h, api, table, when, actionError }, decodeURIComponent(parts[1]));
  } else if (parts[0] === 'schedules') {
    page = 'schedules'; render = () => schedulesPage(ctx, { h, api, table, when, actionError });
  }
  document.body.dataset.page = page;
  for (const a of document.querySelectorAll('#nav a')) {
    a.classList.toggle('active', a.dataset.nav === ({ run: 'runs', schedule: 'schedules' }[page] || page));
  }
  const main = $('#main');
  main.replaceChildren();
  ctx.main = main;
  ctx.every = (ms, fn) => ctx.timers.push(setInterval(fn, ms));
  ctx.ready = () => { if (current === ctx) document.body.dataset.ready = '1'; };
  // A page-level error box for failed loads; a later success clears it.
  ctx.errBox = h('div', { class: 'error', hidden: true });
  main.append(ctx.errBox);
  ctx.fail = (e) => {
    // A 401 shows the token form instead.
    if (ctx.signal.aborted || e.name === 'AbortError' || e.status === 401) return;
    ctx.errBox.textContent = e.message;
    ctx.errBox.hidden = false;
  };
  ctx.ok = () => { ctx.errBox.hidden = true; ctx.errBox.textContent = ''; };
  Promise.resolve().then(render).catch(ctx.fail);
}

// An action's error, shown next to its button until the next attempt.
function actionError(box, e) {
  box.replaceChildren(e ? h('div', { class: 'error', text: e.message }) : '');
}

// ---- #/runs ----------------------------------------------------------------

async function runsPage(ctx, params) {
  const f = {
    status: params.get('status') || '', plugin: params.get('plugin') || '',
    thread: params.get('thread') || '', q: params.get('q') || '',
  };
  const cursor = params.get('cursor') || '';
  const fields = {
    status: h('select', { id: 'filter-status' },
      h('option', { value: '', text: 'any status' }), STATUSES.map((s) => h('option', { value: s, text: s }))),
    plugin: h('input', { id: 'filter-plugin', placeholder: 'plugin' }),
    thread: h('input', { id: 'filter-thread', placeholder: 'thread' }),
    q: h('input', { id: 'filter-q', placeholder: 'text in input/output', type: 'search' }),
  };
  for (const k of Object.keys(f)) fields[k].value = f[k];
  // Filters live in the hash, so a reload or a shared link keeps them.
  const apply = (extra = {}) => {
    const next = `#/runs${query({ ...Object.fromEntries(Object.entries(fields).map(([k, el]) => [k, el.value.trim()])), ...extra })}`;
    if (location.hash === next) route(); else location.hash = next;
  };
  for (const el of Object.values(fields)) {
    el.addEventListener('keydown', (e) => { if (e.key === 'Enter') apply(); });
  }
  const next = h('button', { type: 'button', id: 'next-page', text: 'Next page', disabled: true });
  const tbody = h('tbody');
  const table = h('table', { id: 'runs-table' },
    h('thead', {}, h('tr', {}, ['id', 'status', 'plugin', 'thread', 'attempt', 'created', 'updated'].map((t) => h('th', { text: t })))),
    tbody);

  // The last hour, drawn while the table loads (not waited for).
  const charts = h('section', { id: 'charts', class: 'charts' });
  chartsSection(ctx, api, charts).catch(ctx.fail);
  ctx.main.append(
    charts,
    h('section', { class: 'filters' },
      fields.status, fields.plugin, fields.thread, fields.q,
      h('button', { type: 'button', id: 'filter-apply', onclick: () => apply(), text: 'Apply' }),
      h('a', { href: '#/runs', class: 'button-link', text: 'Clear' })),
    table,
    h('div', { class: 'pager' },
      cursor ? h('a', { href: `#/runs${query(f)}`, text: 'First page' }) : null, next),
    submitForm());

  let nextCursor = null;
  next.addEventListener('click', () => { if (nextCursor != null) apply({ cursor: nextCursor }); });

  const load = async () => {
    const page = await api(`/v1/runs${query({ ...f, limit: 50, cursor })}`, { signal: ctx.signal });
    nextCursor = page.next_cursor;
    next.disabled = nextCursor == null;
    tbody.replaceChildren(...page.runs.map((r) => h('tr', { 'data-run': r.id },
      h('td', {}, runLink(r.id)),
      h('td', {}, badge(r.status)),
      h('td', {}, h('a', { href: `#/runs${query({ plugin: r.plugin })}`, text: r.plugin })),
      h('td', { class: 'mono ellipsis', title: r.thread_id }, h('a', { href: `#/runs${query({ thread: r.thread_id })}`, text: r.thread_id })),
      h('td', { text: `${r.attempt}/${r.max_attempts}` }),
      h('td', {}, when(r.created_at)),
      h('td', {}, when(r.updated_at)))));
    if (!page.runs.length) {
      // A search that ran out of time stops early: the next page goes on.
      const text = nextCursor != null ? 'No match in the runs searched so far; Next page searches older runs.' : 'No runs.';
      tbody.append(h('tr', {}, h('td', { colspan: 7, class: 'muted', text })));
    }
    ctx.ok();
  };
  // Ready once the counts show too (or, if /v1/stats fails, a while later).
  await Promise.all([load(), Promise.race([firstStats, sleep(5000)])]);
  ctx.ready();
  ctx.every(2000, () => load().catch(ctx.fail));
}

function submitForm() {
  const plugin = h('input', { id: 'submit-plugin', placeholder: 'plugin name' });
  const input = h('textarea', { id: 'submit-input', rows: 4, placeholder: '{"prompt": "…"}', spellcheck: 'false' });
  const thread = h('input', { id: 'submit-thread', placeholder: 'thread (optional)' });
  const errs = h('div');
  const submit = async () => {
    actionError(errs, null);
    let value;
    try {
      value = JSON.parse(input.value.trim() || 'null');
    } catch (e) {
      return actionError(errs, new Error(`input is not JSON: ${e.message}`));
    }
    const body = { plugin: plugin.value.trim(), input: value };
    if (thread.value.trim()) body.thread_id = thread.value.trim();
    try {
      const run = await api('/v1/runs', { method: 'POST', body });
      location.hash = `#/runs/${run.id}`;
    } catch (e) { actionError(errs, e); }
  };
  return h('section', { class: 'card submit' },
    h('h2', { text: 'Submit a run' }),
    h('div', { class: 'row' }, plugin, thread),
    input,
    h('div', {}, h('button', { type: 'button', id: 'submit-run', onclick: submit, text: 'Submit' })),
    errs);
}

// ---- #/runs/<id> -----------------------------------------------------------

async function runPage(ctx, id) {
  const status = h('span', { id: 'run-status', class: 'badge' });
  const facts = h('dl', { class: 'facts' });
  const inputPre = h('pre', { id: 'run-input' });
  const outputPre = h('pre', { id: 'run-output' });
  const errorPre = h('pre', { id: 'run-error' });
  const ledger = h('tbody');
  const timelineBox = h('div', { id: 'timeline-box' });
  const stream = h('div', { id: 'stream', class: 'stream' });
  const events = h('ol', { id: 'events', class: 'events' });
  const streamNote = h('div', { class: 'muted small' });
  const actionErrs = h('div');

  // Deliver input: built once so a refresh never eats what is being typed.
  const inputText = h('textarea', { id: 'input-text', rows: 3, placeholder: 'input for the run' });
  const inputBox = h('div', { class: 'card deliver', hidden: true },
    h('h3', { text: 'Deliver input' }), h('div', { class: 'prompt muted' }), inputText,
    h('div', {}, h('button', { type: 'button', id: 'deliver-input', text: 'Deliver input', onclick: () => act('input') })));
  const cancelBtn = h('button', { type: 'button', id: 'cancel-run', class: 'danger', text: 'Cancel run', onclick: () => act('cancel') });
  const pauseBtn = h('button', { type: 'button', id: 'pause-run', text: 'Pause', onclick: () => act(run?.paused_at != null ? 'resume' : 'pause') });
  const tree = childrenSection({ h, api });

  ctx.main.append(
    h('h1', {}, `Run ${id} `, status),
    h('div', { class: 'actions' }, pauseBtn, ' ', cancelBtn), actionErrs, inputBox,
    facts, tree.el,
    h('div', { class: 'grid2' },
      h('section', {}, h('h2', { text: 'Stream' }), stream, streamNote),
      h('section', {}, h('h2', { text: 'Events' }), events)),
    h('h2', { text: 'Output' }), outputPre,
    h('h2', { text: 'Error' }), errorPre,
    h('details', {}, h('summary', { text: 'Input' }), inputPre),
    h('h2', { text: 'Time line' }), timelineBox,
    h('h2', { text: 'Ledger' }),
    h('table', { id: 'ledger', class: 'timeline' },
      h('thead', {}, h('tr', {}, ['seq', 'name', 'class', 'state', 'fence', 'duration', 'started', 'request', 'result', ''].map((t) => h('th', { text: t })))),
      ledger));

  let run = null;
  let waiting = null;   // why a queued run is not running, if the page can tell
  let rateKey = null;   // the rate limit its last suspension waited for

  // Why a queued run is not running: its key paused or at its limit, or
  // its last suspension waiting for a rate limit's room.
  async function whyWaiting(r) {
    if (r.paused_at != null && !['completed', 'failed', 'aborted', 'cancelled'].includes(r.status)) {
      return r.status === 'running' ? 'paused: it stops at its next slice point' : `paused since ${fmtTime(r.paused_at)}: it waits to be resumed`;
    }
    if (r.status !== 'queued' && r.status !== 'waiting_takeover') return null;
    if (r.waiting_for === 'budget') return 'for its tree\'s budget to be raised';
    if (r.waiting_for?.startsWith('input:')) return `for input to ${r.waiting_for.slice(6)}${r.not_before < FOREVER ? ` (until ${fmtTime(r.not_before)})` : ''}`;
    if (r.waiting_for === 'children') return r.not_before < FOREVER ? `for its children (until ${fmtTime(r.not_before)})` : 'for its children';
    if (r.concurrency_key) {
      try {
        const k = await api(`/v1/limits/${encodeURIComponent(r.concurrency_key)}`, { signal: ctx.signal });
        if (k.paused) return `its key ${r.concurrency_key} is paused`;
        if (k.concurrency != null && k.running >= k.concurrency) {
          return `for a slot: key ${r.concurrency_key} has ${k.running} of ${k.concurrency} running`;
        }
      } catch (e) { if (e.status !== 404) throw e; }
    }
    if (rateKey && r.not_before > dbNow()) return `for room in the rate limit ${rateKey} (until ${fmtTime(r.not_before)})`;
    return null;
  }

  async function act(kind, seq) {
    actionError(actionErrs, null);
    const ask = {
      input: `Deliver this input to run ${id}?`,
      cancel: `Cancel run ${id}?`,
      pause: `Pause run ${id}? It is not claimed until resumed.`,
      resume: `Resume run ${id}?`,
      rerun: `Start a new run from call ${seq} of run ${id}? The calls before it replay, none performed; the rest run live.`,
    }[kind];
    if (!confirm(ask)) return;
    try {
      if (kind === 'rerun') {
        const made = await api(`/v1/runs/${id}/rerun`, { method: 'POST', body: { from_seq: seq } });
        location.hash = `#/runs/${made.id}`;
        return;
      }
      const body = kind === 'input' ? { input: inputText.value } : {};
      // Each path spelled out: tests/all/openapi.rs checks the paths this page calls.
      const path = {
        input: `/v1/runs/${id}/input`, cancel: `/v1/runs/${id}/cancel`, pause: `/v1/runs/${id}/pause`, resume: `/v1/runs/${id}/resume`,
      }[kind];
      showRun(await api(path, { method: 'POST', body }));
      if (kind === 'input') inputText.value = '';
      refresh();
    } catch (e) { actionError(actionErrs, e); }
  }

  function fact(label, ...value) { return [h('dt', { text: label }), h('dd', {}, ...value)]; }

  function showRun(r) {
    run = r;
    status.textContent = r.status;
    status.className = `badge status-${r.status}`;
    document.title = `run ${id} · ${r.status} · leasehold`;
    inputBox.hidden = r.status !== 'waiting_input';
    pauseBtn.hidden = FINISHED.has(r.status);
    pauseBtn.textContent = r.paused_at != null ? 'Resume' : 'Pause';
    const held = r.lease_owner && !FINISHED.has(r.status);
    facts.replaceChildren(
      ...fact('plugin', h('a', { href: `#/runs${query({ plugin: r.plugin })}`, text: r.plugin }), ' ',
        h('span', { class: 'mono muted', title: r.plugin_digest, text: short(r.plugin_digest) })),
      ...fact('thread', h('a', { class: 'mono', href: `#/runs${query({ thread: r.thread_id })}`, text: r.thread_id })),
      ...fact('attempt', `${r.attempt}/${r.max_attempts}`),
      ...fact('priority', String(r.priority ?? 0)),
      ...(r.concurrency_key ? fact('concurrency key', h('a', { class: 'mono', href: '#/queues', text: r.concurrency_key })) : []),
      ...(waiting ? fact('waiting', h('span', { id: 'run-waiting', class: 'note', text: waiting })) : []),
      ...fact('lease', held ? `${r.lease_owner}, fence ${r.fence}, ` : `fence ${r.fence}${r.lease_owner ? `, last ${r.lease_owner}` : ''} `,
        held ? countdown(r.lease_expires_at, 'lease-countdown') : h('span', { id: 'lease-countdown', class: 'muted', text: 'not held' })),
      ...fact('heartbeat', when(r.heartbeat_at, false)),
      ...fact('created', when(r.created_at, false)),
      ...fact('started', when(r.started_at, false)),
      ...fact('updated', when(r.updated_at, false)),
      ...fact('finished', when(r.finished_at, false)),
      ...(r.not_before && r.not_before < FOREVER ? fact('not before', when(r.not_before, false)) : []),
      ...(r.idempotency_key ? fact('idempotency key', h('span', { class: 'mono', text: r.idempotency_key })) : []),
      ...(r.pending_input != null ? fact('pending input', h('span', { class: 'mono', text: r.pending_input })) : []),
      ...(r.upgrade_note ? fact('upgrade', h('span', { class: 'note', text: r.upgrade_note })) : []),
      ...(r.schedule_id != null ? fact('schedule', h('a', { id: 'schedule', class: 'mono', href: `#/schedules/${encodeURIComponent(r.schedule_id)}`, text: r.schedule_id }), ' for ', when(r.scheduled_at, false)) : []),
      ...(r.rerun_of != null ? fact('rerun of', h('a', { id: 'rerun-of', href: `#/runs/${r.rerun_of}`, text: `run ${r.rerun_of}` }), ` from call ${r.rerun_from}`) : []),
      ...(r.reruns?.length ? fact('reruns', ...r.reruns.flatMap((n, i) => [i ? ', ' : '', h('a', { class: 'rerun', href: `#/runs/${n}`, text: `run ${n}` })])) : []));
    inputPre.textContent = prettyJson(r.input);
    outputPre.textContent = r.output ?? '';
    errorPre.textContent = r.error ?? '';
  }

  // Which <details> of the ledger are open, so a refresh keeps them open.
  const open = new Set();
  function detail(key, label, text) {
    const d = folded(label, text);
    if (d.tagName === 'DETAILS') {
      d.open = open.has(key);
      d.addEventListener('toggle', () => { if (d.open) open.add(key); else open.delete(key); });
    }
    return d;
  }

  async function loadLedger() {
    const rows = [];
    let after = null;
    for (let i = 0; i < 20; i++) {
      const page = await api(`/v1/runs/${id}/effects${query({ after })}`, { signal: ctx.signal });
      rows.push(...page.effects);
      if (page.next_after == null) break;
      after = page.next_after;
    }
    ledger.replaceChildren(...rows.map((e) => h('tr', {},
      h('td', { text: e.seq }),
      h('td', { class: 'mono', text: e.name }),
      h('td', { text: e.class }),
      h('td', {}, h('span', { class: `state state-${e.state}`, text: e.state })),
      h('td', { text: `${e.fence_started} → ${e.fence_completed ?? '…'}` }),
      h('td', { text: fmtSpan(e.updated_at - e.created_at) }),
      h('td', {}, when(e.created_at)),
      h('td', {}, detail(`${e.seq}:req`, 'request', e.request)),
      h('td', {}, detail(`${e.seq}:res`, 'result', e.result)),
      h('td', {}, h('button', { type: 'button', class: 'small rerun-from', 'data-seq': e.seq, title: 'a new run: the calls before this one replay, the rest run live', text: 'rerun from here', onclick: () => act('rerun', e.seq) })))));
    if (!rows.length) ledger.append(h('tr', {}, h('td', { colspan: 10, class: 'muted', text: 'No effects yet.' })));
    const segs = await api(`/v1/runs/${id}/segments`, { signal: ctx.signal });
    timelineBox.replaceChildren(timeline(run ?? { id }, segs.segments, rows, dbNow()));
  }

  // One refresh at a time; a request during one runs once after it.
  let busy = false, again = false, debounce = null;
  async function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    try {
      const r = await api(`/v1/runs/${id}`, { signal: ctx.signal });
      waiting = await whyWaiting(r);
      showRun(r);
      await tree.refresh(r, ctx.signal);
      await loadLedger();
      ctx.ok();
    } catch (e) { ctx.fail(e); }
    busy = false;
    if (again) { again = false; refresh(); }
  }
  const soon = () => { clearTimeout(debounce); debounce = setTimeout(refresh, 200); };

  const first = await api(`/v1/runs/${id}`, { signal: ctx.signal });
  waiting = await whyWaiting(first);
  showRun(first);
  await tree.refresh(first, ctx.signal);
  await loadLedger();
  ctx.ready();
  ctx.every(2000, () => { if (run && (!FINISHED.has(run.status) || tree.hasOpen())) refresh(); });

  // The stream: this run's deltas by position, struck through and then
  // dropped when a retract voids them (a dead segment's words).
  function onEvent(ev) {
    if (ev.run_id !== id) return;
    const p = ev.payload || {};
    if (ev.kind === 'delta') {
      // As the server's replay does: a delta at pos replaces what stands from pos on.
      for (const s of stream.querySelectorAll('.delta:not(.retracted)')) {
        if (Number(s.dataset.pos) >= p.pos) s.remove();
      }
      stream.append(h('span', { class: 'delta', 'data-pos': p.pos, title: `seq ${ev.seq}, fence ${ev.fence}`, text: p.delta ?? '' }));
    } else {
      if (ev.kind === 'retract') {
        const gone = [...stream.querySelectorAll('.delta:not(.retracted)')]
          .filter((s) => Number(s.dataset.pos) >= p.from && (p.to == null || Number(s.dataset.pos) < p.to));
        gone.forEach((s) => s.classList.add('retracted'));
        setTimeout(() => gone.forEach((s) => s.remove()), RETRACT_LINGER_MS);
      } else if (ev.kind === 'suspended') {
        $('.prompt', inputBox).textContent = p.prompt ?? '';
        rateKey = p.rate ?? null;
      }
      events.append(eventLine(ev));
    }
    soon();
  }
  if (run) followThread(ctx, run.thread_id, onEvent, streamNote);
}

function eventLine(ev) {
  const p = ev.payload || {};
  let text;
  switch (ev.kind) {
    case 'submitted': text = `submitted (${p.plugin ?? ''})`; break;
    case 'suspended': text = `suspended: ${p.waiting_for ? `waiting for ${p.waiting_for} ${(p.children || []).join(', ')}` : (p.status ?? '')}${p.prompt ? ` — ${p.prompt}` : ''}${p.rate ? ` — rate limit ${p.rate}` : ''}${p.not_before && p.not_before < FOREVER ? ` until ${fmtTime(p.not_before)}` : ''}`; break;
    case 'input': text = `input: ${typeof p.input === 'string' ? p.input : JSON.stringify(p.input)}`; break;
    case 'message': text = `message: ${p.status ?? ''}${p.error ? ` — ${p.error}` : ''}`; break;
    case 'cancelled': text = 'cancelled'; break;
    case 'retract': text = `retract ${p.from}..${p.to} (fence ${ev.fence})`; break;
    default: text = ev.kind;
  }
  return h('li', { class: `event event-${ev.kind}` },
    h('span', { class: 'muted mono', text: `#${ev.seq} ` }), h('time', { class: 'muted', title: fmtTime(ev.created_at), text: `${fmtTime(ev.created_at).slice(11)} ` }), text);
}

// Server-sent events over fetch (EventSource cannot send Authorization),
// resumed with Last-Event-ID after an error or an end, until the page goes.
async function followThread(ctx, thread, onEvent, note) {
  const url = `/v1/threads/${encodeURIComponent(thread)}/events?after=0`;
  let last = null;
  while (!ctx.signal.aborted) {
    try {
      const headers = authHeaders({ Accept: 'text/event-stream' });
      if (last != null) headers['Last-Event-ID'] = String(last);
      const res = await fetch(url, { headers, signal: ctx.signal });
      if (!res.ok) throw await apiError(res);
      note.textContent = 'live';
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = '', ev = { data: [] };
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value;
        let nl;
        while ((nl = buf.search(/\r\n|\r|\n/)) >= 0) {
          const line = buf.slice(0, nl);
          buf = buf.slice(nl + (buf.startsWith('\r\n', nl) ? 2 : 1));
          if (line === '') {
            // A blank line ends an event.
            if (ev.data.length) {
              if (ev.id != null) last = ev.id;
              let data = null;
              try { data = JSON.parse(ev.data.join('\n')); } catch { /* a torn event: skip it */ }
              if (data) onEvent(data);
            }
            ev = { data: [] };
          } else if (line[0] !== ':') { // ':' lines are keep-alives
            const c = line.indexOf(':');
            const field = c < 0 ? line : line.slice(0, c);
            const val = c < 0 ? '' : line.slice(c + 1).replace(/^ /, '');
            if (field === 'data') ev.data.push(val);
            else if (field === 'id') ev.id = val;
            else if (field === 'event') ev.kind = val;
          }
        }
      }
      note.textContent = 'stream ended; reconnecting…';
    } catch (e) {
      if (ctx.signal.aborted) return;
      note.textContent = `stream: ${e.message}; reconnecting…`;
    }
    await sleep(1000);
  }
}

// ---- #/plugins -------------------------------------------------------------

async function pluginsPage(ctx) {
  const { plugins } = await api('/v1/plugins', { signal: ctx.signal });
  const rows = [];
  for (const p of plugins) {
    const s = p.settings || {};
    rows.push(h('tr', { class: 'plugin' },
      h('td', {}, h('a', { href: `#/runs${query({ plugin: p.name })}`, text: p.name })),
      h('td', { class: 'mono', title: p.digest, text: short(p.digest) }),
      h('td', { text: fmtBytes(p.size) }),
      h('td', { class: 'mono' }, (s.http_allow || []).length ? s.http_allow.join(', ') : h('span', { class: 'muted', text: 'none' })),
      h('td', { text: s.upgrade ?? '—' }),
      h('td', {}, when(p.created_at)),
      h('td', {}, when(p.updated_at))));
    const versions = (p.versions || []).map((v) => h('tr', { class: v.digest === p.digest ? 'current' : null },
      h('td', { class: 'mono', title: v.digest, text: short(v.digest) + (v.digest === p.digest ? ' (current)' : '') }),
      h('td', {}, when(v.created_at)),
      h('td', { text: v.open_runs })));
    rows.push(h('tr', { class: 'versions' }, h('td', { colspan: 7 },
      table(null, ['version', 'created', 'open runs'], versions))));
  }
  if (!plugins.length) rows.push(h('tr', {}, h('td', { colspan: 7, class: 'muted', text: 'No plugins registered.' })));
  ctx.main.append(h('h1', { text: 'Plugins' }),
    table('plugins-table', ['name', 'digest', 'size', 'http allow-list', 'upgrade', 'created', 'updated'], rows));
  ctx.ready();
}

// ---- #/hosts ---------------------------------------------------------------

async function hostsPage(ctx) {
  const holders = h('div', { id: 'holders' });
  const takeovers = h('div', { id: 'takeovers' });
  const rejected = h('b', { id: 'fenced-writes-rejected', text: '…' });
  const lost = h('b', { id: 'leases-lost', text: '…' });
  ctx.main.append(
    h('h1', { text: 'Hosts and leases' }),
    h('div', { class: 'counters' },
      h('div', { class: 'counter' }, rejected, h('span', { text: 'fenced writes rejected (this host)' })),
      h('div', { class: 'counter' }, lost, h('span', { text: 'leases lost (this host)' }))),
    h('h2', { text: 'Holders' }), holders,
    h('h2', { text: 'Recent takeovers' }), takeovers);
  const load = async () => {
    const l = await api('/v1/leases', { signal: ctx.signal });
    offset = l.now - Date.now();
    rejected.textContent = String(l.fenced_writes_rejected);
    lost.textContent = String(l.leases_lost);
    holders.replaceChildren(...l.holders.map((o) => h('section', { class: 'holder card' },
      h('h3', {}, o.owner, h('span', { class: 'muted', text: ` · ${o.runs.length} run${o.runs.length === 1 ? '' : 's'}` })),
      table(null, ['run', 'status', 'plugin', 'fence', 'lease expires', 'heartbeat'], o.runs.map((r) => h('tr', { 'data-run': r.id },
        h('td', {}, runLink(r.id)), h('td', {}, badge(r.status)), h('td', { text: r.plugin }),
        h('td', { text: r.fence }), h('td', {}, countdown(r.lease_expires_at)), h('td', {}, when(r.heartbeat_at))))))));
    if (!l.holders.length) holders.append(h('p', { class: 'muted', text: 'No host holds a run now.' }));
    takeovers.replaceChildren(l.takeovers.length
      ? table(null, ['run', 'status', 'plugin', 'fence', 'owner', 'attempt', 'updated'], l.takeovers.map((r) => h('tr', { 'data-run': r.id },
        h('td', {}, runLink(r.id)), h('td', {}, badge(r.status)), h('td', { text: r.plugin }), h('td', { text: r.fence }),
        h('td', { text: r.lease_owner ?? '—' }), h('td', { text: r.attempt }), h('td', {}, when(r.updated_at)))))
      : h('p', { class: 'muted', text: 'No run has moved past its first fence.' }));
    ctx.ok();
  };
  await load();
  ctx.ready();
  ctx.every(2000, () => load().catch(ctx.fail));
}

// ---- start -----------------------------------------------------------------

buildCounts();
window.addEventListener('hashchange', route);
route();
refreshStats();
setInterval(refreshStats, 2000);
