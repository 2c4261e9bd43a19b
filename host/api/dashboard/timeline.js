// The run page's time line: each segment of the run as a bar on one time
// axis, with its host, fence and outcome (GET /v1/runs/{id}/segments), and
// below it its effects as bars (the ledger rows its fence started or
// re-issued).
// Drawn as SVG built here: no script or font from anywhere else.

const NS = 'http://www.w3.org/2000/svg';
const W = 940, LABEL = 300, ROW = 18, GAP = 6;
const OUTCOME = { completed: '#17a34a', failed: '#dc2626', suspended: '#2563eb', lease_lost: '#f97316', abandoned: '#6b7280' };
const STATE = { committed: '#17a34a', failed: '#dc2626', started: '#f97316', in_doubt: '#9333ea' };
// Fences drawn at most: the newest.
const MAX_FENCES = 50;

function svg(tag, attrs, ...children) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v != null) el.setAttribute(k, String(v));
  for (const c of children) if (c) el.append(c);
  return el;
}

function text(x, y, s, attrs = {}) {
  const t = svg('text', { x, y, 'font-size': 11, fill: '#374151', ...attrs });
  t.textContent = s;
  return t;
}

function titled(el, s) {
  const t = svg('title', {});
  t.textContent = s;
  el.append(t);
  return el;
}

const ms = (n) => (n < 1000 ? `${n} ms` : `${(n / 1000).toFixed(n < 10_000 ? 2 : 1)} s`);

// The SVG for `run`, its recorded `segments` and its ledger `effects`;
// `now` (epoch ms) ends the axis of a run still going.
export function timeline(run, segments, effects, now) {
  // Every fence up to the newest seen: one with no record is a segment
  // whose host died in it (a re-issued call's row moves to the fence that
  // re-issued it), or a claim given back before its guest started.
  const running = run.status === 'running' ? [run.fence] : [];
  const top = Math.max(0, ...segments.map((s) => s.fence), ...effects.map((e) => e.fence_started), ...running);
  const fences = [];
  for (let f = Math.max(1, top - MAX_FENCES + 1); f <= top; f++) fences.push(f);
  if (!fences.length) {
    const p = document.createElement('p');
    p.className = 'muted';
    p.textContent = 'No segment has run yet.';
    return p;
  }
  const shown = new Set(fences);
  const segs = segments.filter((s) => shown.has(s.fence));
  const effs = effects.filter((e) => shown.has(e.fence_started));
  const end = (e) => (e.state === 'started' ? now : e.updated_at);
  const starts = [...segs.map((s) => s.started_at), ...effs.map((e) => e.created_at)];
  const t0 = starts.length ? Math.min(...starts) : (run.heartbeat_at ?? run.created_at ?? now);
  const t1 = Math.max(t0 + 1, ...segs.map((s) => s.ended_at), ...effs.map(end));
  const x = (t) => LABEL + ((t - t0) / (t1 - t0)) * (W - LABEL - 8);
  const height = 22 + fences.length * (2 * ROW + GAP);
  const s = svg('svg', { id: 'segment-timeline', class: 'timeline-chart', viewBox: `0 0 ${W} ${height}`, role: 'img', 'aria-label': `Run ${run.id}: its segments and their effects on a time line` });
  s.append(text(LABEL, 12, new Date(t0).toLocaleTimeString(), { fill: '#6b7280' }),
    text(W - 8, 12, `+${ms(t1 - t0)}`, { fill: '#6b7280', 'text-anchor': 'end' }));
  fences.forEach((fence, i) => {
    const y = 20 + i * (2 * ROW + GAP);
    const seg = segs.find((g) => g.fence === fence);
    if (seg) {
      const kind = seg.outcome.split(':')[0];
      s.append(text(4, y + 12, `fence ${fence} · ${seg.owner} · ${seg.outcome}`));
      s.append(titled(svg('rect', {
        class: `segment segment-${kind}`, 'data-fence': fence, x: x(seg.started_at), y: y + 2, rx: 2,
        width: Math.max(2, x(seg.ended_at) - x(seg.started_at)), height: ROW - 4, fill: OUTCOME[kind] ?? '#6b7280',
      }), `fence ${fence} on ${seg.owner}: ${seg.outcome}, ${ms(seg.ended_at - seg.started_at)}`));
    } else if (running.includes(fence)) {
      s.append(text(4, y + 12, `fence ${fence} · ${run.lease_owner ?? '?'} · running`, { class: 'segment-running', 'data-fence': fence }));
    } else {
      s.append(titled(text(4, y + 12, `fence ${fence} · no record: its host died in it`, { fill: '#b91c1c', class: 'segment-unrecorded', 'data-fence': fence }),
        'No host recorded this segment: its host died while running it, or gave the run back before its guest started.'));
    }
    for (const e of effs.filter((e) => e.fence_started === fence)) {
      s.append(titled(svg('rect', {
        class: `effect effect-${e.state}`, 'data-seq': e.seq, x: x(e.created_at), y: y + ROW + 3, rx: 1,
        width: Math.max(2, x(end(e)) - x(e.created_at)), height: ROW - 8, fill: STATE[e.state] ?? '#6b7280',
      }), `call ${e.seq}: ${e.name}, ${e.state}, ${ms(end(e) - e.created_at)}${e.fence_completed && e.fence_completed !== fence ? ` (settled under fence ${e.fence_completed})` : ''}`));
    }
  });
  return s;
}
