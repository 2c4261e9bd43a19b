// Page timings for `leasehold bench dashboard`: each page, loaded afresh
// LEASEHOLD_LOADS times, from navigation to its first data rendered
// (body[data-ready="1"]). Prints one JSON line of median ms per page.

import { chromium } from 'playwright-core';

const BASE = process.env.LEASEHOLD_URL;
const TOKEN = process.env.LEASEHOLD_TOKEN || '';
const RUN = process.env.LEASEHOLD_RUN || '1';
const LOADS = Number(process.env.LEASEHOLD_LOADS || 7);
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';

const pages = {
  runs: '#/runs',
  'runs by status': '#/runs?status=failed',
  run: `#/runs/${RUN}`,
  plugins: '#/plugins',
  hosts: '#/hosts',
};

const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
};

const browser = await chromium.launch({
  executablePath: CHROMIUM,
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});
try {
  const page = await (await browser.newContext()).newPage();
  // Signs in: the page keeps the token in the tab's sessionStorage.
  await page.goto(`${BASE}/#token=${encodeURIComponent(TOKEN)}`);
  await page.waitForSelector('body[data-ready="1"]', { timeout: 60_000 });
  const result = {};
  for (const [name, hash] of Object.entries(pages)) {
    const times = [];
    for (let i = 0; i <= LOADS; i++) {
      // A fresh document each time: nothing kept from the load before.
      await page.goto('about:blank');
      const t0 = performance.now();
      await page.goto(`${BASE}/${hash}`);
      await page.waitForSelector('body[data-ready="1"]', { timeout: 60_000 });
      if (i > 0) times.push(performance.now() - t0); // the first warms caches
    }
    result[name] = Math.round(median(times) * 10) / 10;
  }
  process.stdout.write(`${JSON.stringify(result)}\n`);
} finally {
  await browser.close();
}
