// #/schedules: every schedule with its next ticks; #/schedules/<id>: one
// schedule's next times and its latest ticks, the runs it started and the
// ticks it skipped with their reasons (docs/operations.md, "Schedules").
// Refreshed every 2 s. The page's helpers come from app.js.

function times(s) {
  return s.cron ? `${s.cron} (${s.time_zone})` : `every ${s.interval}`;
}

async function flip(ui, errs, s, reload) {
  const { api, actionError } = ui;
  actionError(errs, null);
  const verb = s.paused ? 'Resume' : 'Pause';
  if (!confirm(`${verb} schedule ${s.id}?`)) return;
  try {
    await api(`/v1/schedules/${encodeURIComponent(s.id)}`, { method: 'PATCH', body: { paused: !s.paused } });
    await reload();
  } catch (e) { actionError(errs, e); }
}

function pauseButton(ui, errs, s, reload) {
  return ui.h('button', { type: 'button', class: 'toggle-pause', text: s.paused ? 'Resume' : 'Pause', onclick: () => flip(ui, errs, s, reload) });
}

export async function schedulesPage(ctx, ui) {
  const { h, api, table, when } = ui;
  const list = h('div', { id: 'schedules' });
  const errs = h('div');
  ctx.main.append(
    h('h1', { text: 'Schedules' }),
    h('p', { class: 'muted', text: 'Runs started at the times of a cron expression or an interval. Every host ticks; each time is recorded once, as a run or a skip with its reason.' }),
    errs, list);

  async function load() {
    const all = [];
    let after = null;
    for (let i = 0; i < 10; i++) {
      const page = await api(`/v1/schedules${after ? `?after=${encodeURIComponent(after)}&limit=1000` : '?limit=1000'}`, { signal: ctx.signal });
      all.push(...page.schedules);
      if (page.next == null) break;
      after = page.next;
    }
    const rows = all.map((s) => h('tr', { 'data-schedule': s.id },
      h('td', {}, h('a', { class: 'mono', href: `#/schedules/${encodeURIComponent(s.id)}`, text: s.id })),
      h('td', { text: s.plugin }),
      h('td', { class: 'mono', text: times(s) }),
      h('td', { text: s.overlap }),
      h('td', { class: 'next' }, s.paused ? h('span', { class: 'badge status-waiting_input', text: 'paused' }) : when(s.upcoming[0])),
      h('td', {}, pauseButton(ui, errs, s, load))));
    list.replaceChildren(rows.length
      ? table('schedules-table', ['schedule', 'plugin', 'times', 'overlap', 'next tick', ''], rows)
      : h('p', { class: 'muted', text: 'No schedules. Make one with: leasehold schedules add PLUGIN --cron "0 * * * *"' }));
    ctx.ok();
  }
  await load();
  ctx.ready();
  ctx.every(2000, () => load().catch(ctx.fail));
}

export async function schedulePage(ctx, ui, id) {
  const { h, api, table, when } = ui;
  const head = h('div');
  const errs = h('div');
  const next = h('div', { id: 'upcoming' });
  const ticks = h('div', { id: 'ticks' });
  ctx.main.append(
    h('p', {}, h('a', { href: '#/schedules', text: '← Schedules' })),
    head, errs,
    h('h2', { text: 'Next ticks' }), next,
    h('h2', { text: 'Latest ticks' }), ticks);

  async function load() {
    const s = await api(`/v1/schedules/${encodeURIComponent(id)}`, { signal: ctx.signal });
    head.replaceChildren(
      h('h1', {}, 'Schedule ', h('span', { class: 'mono', text: s.id })),
      h('p', {}, `${s.plugin}, ${times(s)}; overlap ${s.overlap}, catch-up window ${s.catchup_window}, jitter ${s.jitter}. `,
        s.paused ? h('span', { class: 'badge status-waiting_input', text: 'paused' }) : '', ' ',
        pauseButton(ui, errs, s, load)),
      s.note ? h('p', { class: 'muted', text: `Note: ${s.note}` }) : '');
    next.replaceChildren(s.upcoming.length
      ? h('ul', {}, s.upcoming.map((t) => h('li', {}, when(t, false))))
      : h('p', { class: 'muted', text: s.paused ? 'Paused: no ticks until it is resumed.' : 'None: its expression has no more times.' }));
    const rows = (s.recent || []).map((t) => h('tr', { class: `tick-${t.outcome}` },
      h('td', {}, when(t.scheduled_at, false)),
      h('td', {}, h('span', { class: `badge tick-${t.outcome}`, text: t.outcome })),
      h('td', {}, t.run_id != null ? h('a', { href: `#/runs/${t.run_id}`, text: `#${t.run_id}` }) : '—'),
      h('td', {}, t.run_status ? h('span', { class: `badge status-${t.run_status}`, text: t.run_status }) : ''),
      h('td', { class: 'reason', text: `${t.reason || ''}${t.backfill ? ' (backfill)' : ''}` })));
    ticks.replaceChildren(rows.length
      ? table('ticks-table', ['scheduled for', 'outcome', 'run', 'status', 'reason'], rows)
      : h('p', { class: 'muted', text: 'No ticks yet.' }));
    ctx.ok();
  }
  await load();
  ctx.ready();
  ctx.every(2000, () => load().catch(ctx.fail));
}
