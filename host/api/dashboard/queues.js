// #/queues: every concurrency key with a limit or runs, and every rate
// limit on effects (docs/flow-control.md), refreshed every 2 s. A key can
// be paused and resumed from here. The page's helpers come from app.js.

export async function queuesPage(ctx, ui) {
  const { h, api, table, when, fmtSpan, actionError } = ui;
  const keys = h('div', { id: 'keys' });
  const rates = h('div', { id: 'rates' });
  const errs = h('div');
  ctx.main.append(
    h('h1', { text: 'Queues' }),
    h('p', { class: 'muted', text: 'Concurrency keys: at most their limit of runs hold a slot at once, on every host. Rate limits: the calls every run makes to a target, spaced evenly.' }),
    errs,
    h('h2', { text: 'Concurrency keys' }), keys,
    h('h2', { text: 'Rate limits on effects' }), rates);

  // Keeps its limit, flips its pause.
  async function toggle(k) {
    actionError(errs, null);
    const verb = k.paused ? 'Resume' : 'Pause';
    if (!confirm(`${verb} key ${k.key}?`)) return;
    try {
      await api(`/v1/limits/${encodeURIComponent(k.key)}`, { method: 'PUT', body: { concurrency: k.concurrency, paused: !k.paused } });
      await load();
    } catch (e) { actionError(errs, e); }
  }

  async function load() {
    const all = [];
    let after = null;
    for (let i = 0; i < 10; i++) {
      const page = await api(`/v1/limits${after ? `?after=${encodeURIComponent(after)}&limit=1000` : '?limit=1000'}`, { signal: ctx.signal });
      all.push(...page.limits);
      if (page.next == null) break;
      after = page.next;
    }
    const isRate = (l) => 'per_minute' in l;
    const keyRows = all.filter((l) => !isRate(l)).map((k) => {
      const full = k.concurrency != null && k.running >= k.concurrency;
      return h('tr', { 'data-key': k.key, class: full ? 'full' : null },
        h('td', { class: 'mono', text: k.key }),
        h('td', { text: k.concurrency ?? '—' }),
        h('td', { text: k.running }),
        h('td', { text: k.queued }),
        h('td', {}, k.paused ? h('span', { class: 'badge status-waiting_input', text: 'paused' }) : (full ? 'at its limit' : '')),
        h('td', {}, h('button', { type: 'button', class: 'toggle-pause', text: k.paused ? 'Resume' : 'Pause', onclick: () => toggle(k) })));
    });
    keys.replaceChildren(keyRows.length
      ? table('keys-table', ['key', 'limit', 'running', 'queued', 'state', ''], keyRows)
      : h('p', { class: 'muted', text: 'No key has a limit or runs waiting.' }));
    const rateRows = all.filter(isRate).map((r) => h('tr', { 'data-key': r.key },
      h('td', { class: 'mono', text: r.key }),
      h('td', { text: r.per_minute ?? '—' }),
      h('td', { text: r.tokens_per_minute ?? '—' }),
      h('td', { text: r.wait_ms > 0 ? `next call in ${fmtSpan(r.wait_ms)}` : 'room now' }),
      h('td', {}, r.held_until != null ? [h('span', { class: 'held', text: 'Retry-After, ends ' }), when(r.held_until)] : '')));
    rates.replaceChildren(rateRows.length
      ? table('rates-table', ['key', 'per minute', 'tokens a minute', 'room', 'provider hold'], rateRows)
      : h('p', { class: 'muted', text: 'No rate limits. Set one with: leasehold limits set http:HOST:PORT --per-minute N' }));
    ctx.ok();
  }
  await load();
  ctx.ready();
  ctx.every(2000, () => load().catch(ctx.fail));
}
