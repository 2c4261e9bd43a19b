// The Runs page's charts of the last hour, from GET /v1/stats/history
// (the rollup every host keeps): runs finished a minute by status, the
// wait from submit to first claim (p50, p99), runs queued and running.
// Drawn as SVG built here: no script or font from anywhere else.

const NS = 'http://www.w3.org/2000/svg';
const W = 360, H = 120, PAD = 22;
const COLORS = { completed: '#17a34a', failed: '#dc2626', aborted: '#f97316', cancelled: '#6b7280', p50: '#2563eb', p99: '#9333ea', queued: '#6b7280', running: '#2563eb' };

function svg(tag, attrs, ...children) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v != null) el.setAttribute(k, String(v));
  for (const c of children) if (c) el.append(c);
  return el;
}

function label(x, y, text, anchor = 'start') {
  const t = svg('text', { x, y, 'font-size': 10, fill: '#6b7280', 'text-anchor': anchor });
  t.textContent = text;
  return t;
}

// A frame with its y axis' top value and the first and last minutes.
function frame(cls, title, max, unit, points, legend) {
  const s = svg('svg', { class: `chart ${cls}`, viewBox: `0 0 ${W} ${H + 16}`, role: 'img', 'aria-label': title });
  const t = svg('title', {});
  t.textContent = title;
  s.append(t,
    svg('line', { x1: PAD, y1: H, x2: W, y2: H, stroke: '#d1d5db' }),
    label(PAD - 3, H, '0', 'end'));
  // The top of the y axis, then the legend, along the top.
  const top = `max ${max}${unit}`;
  s.append(label(PAD + 2, 10, top));
  if (points.length) {
    const hm = (ms) => { const d = new Date(ms); return `${String(d.getHours()).padStart(2, '0')}:${String(d.getMinutes()).padStart(2, '0')}`; };
    s.append(label(PAD, H + 12, hm(points[0].minute)), label(W, H + 12, hm(points[points.length - 1].minute), 'end'));
  }
  let lx = PAD + 14 + top.length * 6;
  for (const name of legend) {
    s.append(svg('rect', { x: lx, y: 2, width: 8, height: 8, fill: COLORS[name] }), label(lx + 11, 10, name));
    lx += 14 + name.length * 6;
  }
  return s;
}

const xOf = (i, n) => PAD + (i + 0.5) * ((W - PAD) / n);
const yOf = (v, max) => H - (v / max) * (H - 14);

function finishedChart(points) {
  const keys = ['completed', 'failed', 'aborted', 'cancelled'];
  const total = (p) => (p.finished ? keys.reduce((a, k) => a + p.finished[k], 0) : 0);
  const max = Math.max(1, ...points.map(total));
  const s = frame('chart-finished', 'Runs finished a minute, by status', max, '', points, keys);
  const bw = Math.max(1, (W - PAD) / points.length - 1);
  points.forEach((p, i) => {
    if (!p.finished) return;
    let y = H;
    for (const k of keys) {
      const v = p.finished[k];
      if (!v) continue;
      const h = (v / max) * (H - 14);
      y -= h;
      const bar = svg('rect', { class: `bar bar-${k}`, x: xOf(i, points.length) - bw / 2, y, width: bw, height: h, fill: COLORS[k] });
      const t = svg('title', {});
      t.textContent = `${new Date(p.minute).toLocaleTimeString()}: ${v} ${k}`;
      bar.append(t);
      s.append(bar);
    }
  });
  return s;
}

function lineChart(cls, title, points, series, unit) {
  const max = Math.max(1, ...points.flatMap((p) => series.map(([, f]) => f(p) ?? 0)));
  const s = frame(cls, title, max, unit, points, series.map(([n]) => n));
  for (const [name, f] of series) {
    const pts = points.map((p, i) => [i, f(p)]).filter(([, v]) => v != null);
    if (!pts.length) continue;
    s.append(svg('polyline', {
      class: `line line-${name}`, fill: 'none', stroke: COLORS[name], 'stroke-width': 1.5,
      points: pts.map(([i, v]) => `${xOf(i, points.length).toFixed(1)},${yOf(v, max).toFixed(1)}`).join(' '),
    }));
    for (const [i, v] of pts) s.append(svg('circle', { class: `dot dot-${name}`, cx: xOf(i, points.length), cy: yOf(v, max), r: 1.6, fill: COLORS[name] }));
  }
  return s;
}

// The charts, in `box`, refreshed every 30 s while the page is shown.
export async function chartsSection(ctx, api, box) {
  async function load() {
    const hist = await api('/v1/stats/history?minutes=60', { signal: ctx.signal });
    const points = hist.minutes;
    box.replaceChildren(
      finishedChart(points),
      lineChart('chart-wait', 'Submit to start (ms), p50 and p99', points,
        [['p50', (p) => p.start_wait_p50_ms], ['p99', (p) => p.start_wait_p99_ms]], ' ms'),
      lineChart('chart-load', 'Runs queued and running', points, [['queued', (p) => p.queued], ['running', (p) => p.running]], ''));
  }
  await load();
  ctx.every(30_000, () => load().catch(ctx.fail));
}
