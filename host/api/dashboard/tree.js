// The run page's tree (docs/concepts.md, "Child runs"): the run's parent
// and root, and its children with each one's status and how it ended,
// refreshed with the page while the run or any child is open. The page's
// helpers come from app.js.

const FINISHED = new Set(['completed', 'failed', 'aborted', 'cancelled']);

export function childrenSection(ui) {
  const { h, api } = ui;
  const links = h('p', { id: 'run-tree', class: 'muted' });
  const body = h('tbody');
  const summary = h('p', { id: 'children-summary', class: 'muted' });
  const budget = h('p', { id: 'run-budget', class: 'note', hidden: true });
  const el = h('section', { id: 'children-section', hidden: true },
    h('h2', { text: 'Children' }), links, budget, summary,
    h('table', { id: 'children' },
      h('thead', {}, h('tr', {}, ['run', 'status', 'plugin', 'waiting for', 'output or error'].map((t) => h('th', { text: t })))),
      body));
  let open = false;

  async function refresh(run, signal) {
    // Each path spelled out: tests/all/openapi.rs checks the paths this page calls.
    const kids = [];
    let cursor = null;
    for (let i = 0; i < 10; i++) {
      const page = await api(`/v1/runs/${run.id}/children${cursor == null ? '' : `?cursor=${cursor}`}`, { signal });
      kids.push(...page.runs);
      if (page.next_cursor == null) break;
      cursor = page.next_cursor;
    }
    kids.sort((a, b) => a.id - b.id);
    const b = await api(`/v1/runs/${run.id}/budget`, { signal });
    const parts = [];
    if (b.tokens != null) parts.push(`${b.spent} tokens spent and ${b.held} held of ${b.tokens}`);
    if (b.usd != null) parts.push(`${dollars(b.spent_usd)} spent and ${dollars(b.held_usd)} held of ${dollars(b.usd)}`);
    budget.hidden = parts.length === 0;
    budget.textContent = parts.length === 0 ? '' : `budget: ${parts.join('; ')}, by run ${b.holder_id} and the runs below it`
      + (run.waiting_for === 'budget' ? ' — this run waits for a raise' : '');
    const isChild = run.parent_id != null;
    el.hidden = !isChild && kids.length === 0 && parts.length === 0;
    links.replaceChildren(...(isChild ? [
      'child of ', h('a', { id: 'run-parent', href: `#/runs/${run.parent_id}`, text: `run ${run.parent_id}` }),
      ', in the tree of ', h('a', { id: 'run-root', href: `#/runs/${run.root_id}`, text: `run ${run.root_id}` }),
    ] : []));
    const counts = {};
    for (const k of kids) counts[k.status] = (counts[k.status] || 0) + 1;
    summary.textContent = kids.length
      ? `${kids.length} children: ${Object.entries(counts).map(([s, n]) => `${n} ${s}`).join(', ')}`
      : (isChild ? 'no children' : '');
    body.replaceChildren(...kids.map((k) => h('tr', { 'data-run': k.id },
      h('td', {}, h('a', { href: `#/runs/${k.id}`, text: String(k.id) })),
      h('td', {}, h('span', { class: `badge status-${k.status}`, text: k.status })),
      h('td', { text: k.plugin }),
      h('td', { text: k.waiting_for ?? '' }),
      h('td', { class: 'mono', text: (k.output ?? k.error ?? '').slice(0, 200) }))));
    open = kids.some((k) => !FINISHED.has(k.status));
  }

  return { el, refresh, hasOpen: () => open };
}

/** Dollars to the cent, or to six places under a cent. */
function dollars(usd) {
  return '$' + (usd !== 0 && Math.abs(usd) < 0.01 ? usd.toFixed(6) : usd.toFixed(2));
}
