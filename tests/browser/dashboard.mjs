// Drives the dashboard in Chromium for tests/all/dashboard.rs.
//
// Protocol with the Rust side: this script prints `SYNC <name> <json>` on
// stdout and waits for one line on stdin before going on; everything else
// goes to stderr. Exit 0 when every step passes; on a failed check, print
// why, save failure.png and exit 1.

import { chromium } from 'playwright-core';
import { createInterface } from 'node:readline';
import { join } from 'node:path';
import { mkdirSync } from 'node:fs';

const BASE = process.env.LEASEHOLD_URL || 'http://127.0.0.1:8080';
const TOKEN = process.env.LEASEHOLD_TOKEN || '';
const SHOTS = process.env.LEASEHOLD_SCREENSHOTS || '.';
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const S = JSON.parse(process.env.LEASEHOLD_SCENARIO || '{}');
const T = 15_000; // every wait's timeout

mkdirSync(SHOTS, { recursive: true });
const log = (...a) => console.error('[dashboard]', ...a);

// One line of stdin per SYNC.
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
async function sync(name, data = {}) {
  process.stdout.write(`SYNC ${name} ${JSON.stringify(data)}\n`);
  const { done } = await withTimeout(lines.next(), 120_000, `an answer to SYNC ${name}`);
  if (done) throw new Error(`stdin closed while waiting after SYNC ${name}`);
}

function withTimeout(promise, ms, what) {
  let timer;
  return Promise.race([
    promise,
    new Promise((_, reject) => { timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms); }),
  ]).finally(() => clearTimeout(timer));
}

function check(cond, message) {
  if (!cond) throw new Error(`check failed: ${message}`);
}

const browser = await chromium.launch({
  executablePath: CHROMIUM,
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'],
});
const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
const page = await context.newPage();
page.setDefaultTimeout(T);

// Console errors fail the run at the end, except the browser's own lines
// for responses the steps expect (the 409 refusal) and aborted fetches.
const problems = [];
const expected = [/status of 409/, /net::ERR_ABORTED/, /AbortError/];
page.on('console', (m) => {
  if (m.type() !== 'error') return;
  if (expected.some((re) => re.test(m.text()))) return;
  problems.push(`console: ${m.text()}`);
});
page.on('pageerror', (e) => problems.push(`pageerror: ${e.message}`));

const shot = (name) => page.screenshot({ path: join(SHOTS, name), fullPage: true });
const ready = () => page.waitForSelector('body[data-ready="1"]', { state: 'attached' });

// Navigates within the app and waits for the new page's first data.
async function open(hash, pageName) {
  await page.evaluate((h) => { location.hash = h; }, hash);
  await page.waitForFunction((p) => document.body.dataset.page === p && document.body.dataset.ready === '1', pageName);
}

const text = (sel) => page.locator(sel).textContent({ timeout: T });

// Polls `sel`'s text until `pred` holds (checked here, not in the page).
async function waitText(sel, pred, what, timeout = T) {
  const deadline = Date.now() + timeout;
  let last = null;
  for (;;) {
    last = await page.evaluate((s) => document.querySelector(s)?.textContent ?? null, sel);
    if (last != null && pred(last)) return last;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}: ${sel} reads ${JSON.stringify(last)}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}
const statusIs = (want) => waitText('#run-status', (t) => want.includes(t.trim()), `#run-status in ${want}`);

let step = 'start';
async function steps() {
  // 1. The runs page, with the token from the fragment.
  step = '1 runs page';
  await page.goto(`${BASE}/#token=${encodeURIComponent(TOKEN)}`);
  await ready();
  check(await page.evaluate(() => document.body.dataset.page) === 'runs', 'the default page is runs');
  check(!page.url().includes('token='), `the token left the address (${page.url()})`);
  await page.waitForFunction(() => Number(document.querySelector('[data-status="waiting_input"]')?.textContent) >= 1);
  await shot('runs.png');
  log('1 runs page ok');

  // 2. Filter by status, then clear the filter.
  step = '2 filter by status';
  await page.selectOption('#filter-status', 'waiting_input');
  await page.click('#filter-apply');
  await page.waitForFunction((id) => {
    const badges = [...document.querySelectorAll('#runs-table tbody .badge')];
    return location.hash.includes('status=waiting_input') && document.body.dataset.ready === '1'
      && document.querySelector(`#runs-table tr[data-run="${id}"]`)
      && badges.length > 0 && badges.every((b) => b.textContent === 'waiting_input');
  }, S.wait_run);
  await page.selectOption('#filter-status', '');
  await page.click('#filter-apply');
  await page.waitForFunction(() => !location.hash.includes('status=') && document.body.dataset.ready === '1');
  log('2 filter ok');

  // 3. Submit through the form, watch the stream arrive live.
  step = '3 submit and stream';
  await page.fill('#submit-plugin', S.submit.plugin);
  await page.fill('#submit-input', JSON.stringify(S.submit.input));
  await page.click('#submit-run');
  await page.waitForFunction(() => /^#\/runs\/\d+$/.test(location.hash) && document.body.dataset.ready === '1');
  const submitted = Number(new URL(page.url()).hash.split('/')[2]);
  check(submitted > 0, `a run id in ${page.url()}`);
  // Record, in the page, what the stream and status read at each change.
  await page.evaluate(() => {
    window.__seen = [];
    const note = () => window.__seen.push([document.querySelector('#stream')?.textContent, document.querySelector('#run-status')?.textContent]);
    new MutationObserver(note).observe(document.querySelector('main'), { subtree: true, childList: true, characterData: true });
  });
  await sync('submitted', { id: submitted });
  await waitText('#stream', (t) => t.includes('hello '), 'the first delta');
  await waitText('#stream', (t) => t.includes('hello world'), 'the whole stream');
  await statusIs(['completed']);
  const seen = await page.evaluate(() => window.__seen);
  check(seen.some(([s, st]) => s && s.includes('hello ') && !s.includes('world') && st !== 'completed'),
    '"hello " showed before the run completed (the stream is live)');
  await shot('run.png');
  log('3 submit and stream ok');

  // 4. Deliver input to the waiting run.
  step = '4 deliver input';
  await open(`#/runs/${S.wait_run}`, 'run');
  await statusIs(['waiting_input']);
  await page.fill('#input-text', 'operator');
  page.once('dialog', (d) => d.accept());
  await page.click('#deliver-input');
  await sync('input', { id: S.wait_run });
  await statusIs(['completed']);
  await waitText('#run-output', (t) => t.includes('hello operator'), 'the output');
  log('4 input ok');

  // 5. Cancel a queued run; a finished one refuses.
  step = '5 cancel';
  await open(`#/runs/${S.cancel_run}`, 'run');
  page.once('dialog', (d) => d.accept());
  await page.click('#cancel-run');
  await statusIs(['cancelled']);
  await open(`#/runs/${S.done_run}`, 'run');
  page.once('dialog', (d) => d.accept());
  await page.click('#cancel-run');
  await page.locator('.error', { hasText: /finished|conflict/ }).first().waitFor({ state: 'visible' });
  log('5 cancel ok:', await page.locator('.error', { hasText: /finished|conflict/ }).first().textContent());

  // 6. A takeover: the dead worker's deltas struck through, then gone.
  step = '6 retract after a takeover';
  await open(`#/runs/${S.crash_run}`, 'run');
  await waitText('#stream', (t) => t.includes('dead half '), 'the dead worker\'s deltas');
  await sync('crash', { id: S.crash_run });
  await page.waitForSelector('.delta.retracted', { state: 'attached', timeout: 30_000 });
  await shot('retract.png');
  await page.waitForFunction(() => !document.querySelector('.delta.retracted')
    && document.querySelector('#stream').textContent.trim() === 'the whole answer', null, { timeout: 30_000 })
    .catch(async (e) => { throw new Error(`the retracted deltas gone and the new answer whole: ${e.message.split('\n')[0]}; #stream reads ${JSON.stringify(await text('#stream'))}`); });
  await page.waitForFunction(() => document.querySelector('#run-status').textContent !== 'running');
  log('6 retract ok; status', await text('#run-status'));

  // 7. Plugins and hosts.
  step = '7 plugins and hosts';
  await open('#/plugins', 'plugins');
  check((await text('#plugins-table')).includes('testkit'), '#plugins-table lists testkit');
  await shot('plugins.png');
  await open('#/hosts', 'hosts');
  await page.waitForSelector(`#takeovers a[href="#/runs/${S.crash_run}"]`, { state: 'attached' });
  await shot('hosts.png');
  log('7 plugins and hosts ok');

  // 8. Queues: a paused key with its queued run, a held rate limit; the
  // run page says why the run waits; resuming the key from the page.
  step = '8 queues';
  await open('#/queues', 'queues');
  await page.waitForSelector('#keys-table tr[data-key="tenant-a"]', { state: 'attached' });
  const keyRow = await text('#keys-table tr[data-key="tenant-a"]');
  check(keyRow.includes('paused') && keyRow.includes('Resume'), `tenant-a's row reads ${JSON.stringify(keyRow)}`);
  const rateRow = await text('#rates-table tr[data-key="http:api.example.com:443"]');
  check(rateRow.includes('60') && rateRow.includes('Retry-After'), `the rate's row reads ${JSON.stringify(rateRow)}`);
  await shot('queues.png');
  await open(`#/runs/${S.keyed_run}`, 'run');
  await waitText('#run-waiting', (t) => t.includes('tenant-a is paused'), 'the run page saying its key is paused');
  check((await text('dl.facts')).includes('tenant-a'), 'the run page names its key');
  await open('#/queues', 'queues');
  page.once('dialog', (d) => d.accept());
  await page.click('#keys-table tr[data-key="tenant-a"] .toggle-pause');
  await waitText('#keys-table tr[data-key="tenant-a"]', (t) => t.includes('Pause') && !t.includes('paused'), 'tenant-a resumed');
  log('8 queues ok');

  // 9. A tree: a parent waiting for two children that wait for input; the
  // children end (input delivered by the Rust side) and the page shows
  // them completed and the parent woken and completed, live.
  step = '9 tree';
  await open(`#/runs/${S.tree_run}`, 'run');
  await waitText('#children-summary', (t) => t.includes('2 children') && t.includes('2 waiting_input'), 'two children waiting for input');
  await waitText('#run-waiting', (t) => t.includes('for its children'), 'the parent saying it waits for its children');
  await waitText('#run-budget', (t) => t.includes('of 1000000'), 'the tree\'s budget');
  await shot('tree.png');
  await sync('tree', { id: S.tree_run });
  await waitText('#children-summary', (t) => t.includes('2 completed'), 'both children completed, live', 30_000);
  await statusIs(['completed']);
  await open(`#/runs/${S.tree_child}`, 'run');
  await page.waitForSelector(`#run-parent[href="#/runs/${S.tree_run}"]`, { state: 'attached' });
  await page.waitForSelector(`#run-root[href="#/runs/${S.tree_run}"]`, { state: 'attached' });
  log('9 tree ok');

  // 10. Rerun a finished run from a ledger row; the new run names it, and
  // it names its rerun. Pause the new run, then resume it.
  step = '10 rerun and pause';
  await open(`#/runs/${S.done_run}`, 'run');
  await page.waitForSelector('#ledger .rerun-from[data-seq="0"]', { state: 'attached' });
  page.once('dialog', (d) => d.accept());
  await page.click('#ledger .rerun-from[data-seq="0"]');
  await page.waitForFunction((done) => /^#\/runs\/\d+$/.test(location.hash) && location.hash !== `#/runs/${done}`
    && document.querySelector(`#rerun-of[href="#/runs/${done}"]`), S.done_run);
  const rerun = Number(new URL(page.url()).hash.split('/')[2]);
  page.once('dialog', (d) => d.accept());
  await page.click('#pause-run');
  await waitText('#pause-run', (t) => t === 'Resume', 'the button offering to resume');
  await waitText('#run-waiting', (t) => t.includes('paused'), 'the run page saying the run is paused');
  await shot('rerun.png');
  page.once('dialog', (d) => d.accept());
  await page.click('#pause-run');
  await waitText('#pause-run', (t) => t === 'Pause', 'the button offering to pause again');
  await open(`#/runs/${S.done_run}`, 'run');
  await page.waitForSelector(`dl.facts a.rerun[href="#/runs/${rerun}"]`, { state: 'attached' });
  log('10 rerun and pause ok');

  // 11. Schedules: the list with its next tick; a schedule's page with the
  // run it started and the tick it skipped, and why; pause and resume it;
  // the run names its schedule.
  step = '11 schedules';
  await open('#/schedules', 'schedules');
  await page.waitForSelector('#schedules-table tr[data-schedule="nightly"] .next time', { state: 'attached' });
  check((await text('#schedules-table tr[data-schedule="nightly"]')).includes('30 2 * * * (Europe/Berlin)'), 'nightly\'s row shows its times');
  await page.click('#schedules-table tr[data-schedule="nightly"] a');
  await page.waitForFunction(() => location.hash === '#/schedules/nightly' && document.body.dataset.ready === '1');
  await page.waitForSelector(`#ticks-table a[href="#/runs/${S.schedule_run}"]`, { state: 'attached' });
  check((await text('#ticks-table tr.tick-skipped')).includes(`overlap: run ${S.schedule_run} is still open`), 'the skipped tick says why');
  check((await page.locator('#upcoming li').count()) === 5, 'five next ticks');
  await shot('schedule.png');
  page.once('dialog', (d) => d.accept());
  await page.click('.toggle-pause');
  await waitText('#upcoming', (t) => t.includes('Paused'), 'the schedule paused');
  page.once('dialog', (d) => d.accept());
  await page.click('.toggle-pause');
  await waitText('#upcoming', (t) => !t.includes('Paused'), 'the schedule resumed');
  await open(`#/runs/${S.schedule_run}`, 'run');
  await page.waitForSelector('#schedule[href="#/schedules/nightly"]', { state: 'attached' });
  log('11 schedules ok');

  // 12. The Runs page's charts of the last hour: a bar for the run that
  // finished two minutes ago, and the waits of this test's first claims.
  step = '12 charts';
  await open('#/runs', 'runs');
  await page.waitForSelector('#charts svg.chart-finished rect.bar-completed', { state: 'attached' });
  await page.waitForSelector('#charts svg.chart-wait circle.dot-p50', { state: 'attached' });
  await page.waitForSelector('#charts svg.chart-load', { state: 'attached' });
  await shot('charts.png');
  log('12 charts ok');

  // 13. The run page's time line: host-a's segment died with its model
  // call in flight (no record; the call's bar under its fence), host-b's
  // finished the run.
  step = '13 time line';
  await open(`#/runs/${S.crash_run}`, 'run');
  await page.waitForSelector('#segment-timeline .segment-unrecorded[data-fence="1"]', { state: 'attached', timeout: 30_000 });
  await page.waitForSelector('#segment-timeline rect.segment-completed[data-fence="2"]', { state: 'attached', timeout: 30_000 });
  await page.waitForSelector('#segment-timeline rect.effect', { state: 'attached' });
  const labels = await text('#segment-timeline');
  if (!labels.includes('host-b')) throw new Error(`the time line names no host-b: ${labels}`);
  await page.locator('#segment-timeline').screenshot({ path: join(SHOTS, 'timeline.png') });
  log('13 time line ok');

  await sync('done');
}

let code = 0;
try {
  await steps();
  if (problems.length) throw new Error(`errors in the page:\n  ${problems.join('\n  ')}`);
  log('all steps passed');
} catch (e) {
  code = 1;
  log(`FAILED in step ${step}:`, e.message);
  if (problems.length) log('page errors:', problems);
  await page.screenshot({ path: join(SHOTS, 'failure.png'), fullPage: true }).catch(() => {});
}
await browser.close().catch(() => {});
process.exit(code);
