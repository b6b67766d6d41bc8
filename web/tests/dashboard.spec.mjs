// The dashboard in Chromium, driven by playwright-core (plain node, no test
// runner). Started by server/tests/dashboard_browser.rs against a server
// whose job CANOPY_JOB_ID is running with real devices; the devices hold
// one round until this script has paused and resumed the job and written
// CANOPY_RESUMED_FILE.
//
// Exits non-zero with the first failed check. Screenshots go to
// CANOPY_ARTIFACTS.
import { chromium } from "playwright-core";
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";

function env(name) {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set; run this through server/tests/dashboard_browser.rs`);
  return value;
}

const base = env("CANOPY_URL");
const token = env("CANOPY_TOKEN");
const jobId = Number(env("CANOPY_JOB_ID"));
const modelVersionId = Number(env("CANOPY_MODEL_VERSION_ID"));
const rounds = Number(env("CANOPY_ROUNDS"));
const declineReason = env("CANOPY_DECLINE_REASON");
const artifacts = env("CANOPY_ARTIFACTS");
const executablePath = env("CANOPY_CHROMIUM");
/// Written once the job was paused and resumed: the devices hold a round
/// until then, so the job cannot end before the buttons are tried.
const resumedFile = env("CANOPY_RESUMED_FILE");
/// The dashboard's page of rounds per poll (POLL_ROUNDS in dashboard.js).
const POLL_ROUNDS = 20;
const DESKTOP = { width: 1280, height: 900 };
const NARROW = { width: 420, height: 900 };

function check(condition, message) {
  if (!condition) throw new Error(message);
}

function same(actual, expected, what) {
  const a = JSON.stringify(actual), e = JSON.stringify(expected);
  check(a === e, `${what}: expected ${e}, got ${a}`);
}

function log(message) {
  console.log(`[dashboard.spec] ${message}`);
}

async function eventually(what, probe, timeoutMs = 30000) {
  const deadline = Date.now() + timeoutMs;
  let last;
  for (;;) {
    last = await probe();
    if (last.ok) return last.value;
    if (Date.now() > deadline) throw new Error(`${what}: not within ${timeoutMs} ms; last: ${JSON.stringify(last.value)}`);
    await new Promise((resolve) => setTimeout(resolve, 150));
  }
}

async function main() {
  mkdirSync(artifacts, { recursive: true });
  const browser = await chromium.launch({
    executablePath,
    // The network here is closed: without these Chromium keeps trying to
    // reach its own services, and a root user needs --no-sandbox.
    args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
      "--no-first-run", "--disable-component-update", "--disable-sync"],
  });
  try {
    await run(browser);
  } finally {
    await browser.close();
  }
}

async function run(browser) {
  // The server's certificate is the test's self-signed one.
  const context = await browser.newContext({ ignoreHTTPSErrors: true, viewport: DESKTOP });
  const api = async (path, method = "GET") => {
    const response = await context.request.fetch(base + path, { method, headers: { Authorization: "Bearer " + token } });
    check(response.ok(), `${method} ${path} answered ${response.status()}: ${await response.text()}`);
    return response.json();
  };
  const page = await context.newPage();
  const problems = [];
  page.on("console", (message) => {
    if (message.type() === "error") problems.push(`console: ${message.text()} (${message.location().url})`);
  });
  page.on("pageerror", (error) => problems.push("page error: " + error.message));
  const roundLists = [];
  page.on("request", (request) => {
    const url = new URL(request.url());
    if (/^\/api\/v1\/jobs\/\d+\/rounds$/.test(url.pathname)) roundLists.push(url.searchParams);
  });

  // The server keeps the policy strict for the page and every asset.
  const response = await page.goto(`${base}/dashboard#token=${encodeURIComponent(token)}&job=${jobId}`);
  for (const [path, policy] of [["/dashboard", response.headers()["content-security-policy"]],
    ...await Promise.all(["/dashboard.js", "/dashboard-charts.js", "/dashboard.css", "/dashboard-icon.svg"].map(async (path) =>
      [path, (await context.request.get(base + path)).headers()["content-security-policy"]]))]) {
    check(policy && policy.includes("default-src 'self'"), `${path} has no default-src 'self' policy: ${policy}`);
    check(!/unsafe-|\*|https?:/.test(policy), `${path}'s policy allows more than this origin: ${policy}`);
  }
  // The page's script takes the token out of the address bar once it runs.
  await page.waitForFunction(() => !location.href.includes("token="), null, { timeout: 15_000 }).catch(() => {});
  check(problems.length === 0, `the page loaded without errors: ${JSON.stringify(problems)}`);
  check(!page.url().includes("token="), "the token stays out of the address bar");

  log("live: waiting for two finished rounds on the loss curve");
  const lossRounds = () => page.$eval('#chart-loss polyline[data-series="train_loss"]', (l) => l.dataset.rounds);
  await page.waitForFunction(() => {
    const line = document.querySelector('#chart-loss polyline[data-series="train_loss"]');
    return line && line.dataset.rounds.split(",").filter(Boolean).length >= 2;
  }, null, { timeout: 90000 });
  same(await page.textContent("#job-title"), `Job ${jobId}: digits-dashboard`, "job title");
  check(await page.isHidden("#job-secure"), "a plain job shows no secure marker");
  const settings = await page.textContent("#job-settings");
  for (const expected of ["fedavgm (momentum 0.5)", "exponential (factor 0.97)", "digits", "federated on 100%"]) {
    check(settings.includes(expected), `settings show "${expected}": ${settings}`);
  }
  const before = (await lossRounds()).split(",").length;

  log("pause and resume with the buttons");
  const action = async (name, expected) => {
    const answered = page.waitForResponse((r) => r.url().endsWith(`/api/v1/jobs/${jobId}/${name}`) && r.request().method() === "POST");
    await page.click(`#job-controls button[data-action="${name}"]`);
    const reply = await answered;
    same([reply.status(), (await reply.json()).state], [200, expected], `${name} answer`);
  };
  await action("pause", "paused");
  same((await api(`/api/v1/jobs/${jobId}`)).state, "paused", "the API's state after Pause");
  await page.waitForFunction(() => document.getElementById("job-state").textContent === "paused");
  check(await page.isDisabled('button[data-action="pause"]') && await page.isEnabled('button[data-action="resume"]'),
    "a paused job offers Resume, not Pause");
  await page.screenshot({ path: join(artifacts, "paused-desktop.png"), fullPage: true });
  await action("resume", "running");
  // Still running: the devices hold the round until resumedFile exists.
  same((await api(`/api/v1/jobs/${jobId}`)).state, "running", "the API's state after Resume");
  writeFileSync(resumedFile, "resumed\n");

  log("waiting for the job to complete");
  await eventually("job completed", async () => {
    const job = await api(`/api/v1/jobs/${jobId}`);
    return { ok: job.state === "completed", value: job.state };
  }, 180000);
  const all = [];
  let cursor = null;
  do {
    const pageOf = await api(`/api/v1/jobs/${jobId}/rounds?limit=100` + (cursor ? `&cursor=${cursor}` : ""));
    all.push(...pageOf.items);
    cursor = pageOf.next_cursor;
  } while (cursor);
  const succeeded = all.filter((r) => r.state === "succeeded" && r.kind !== "statistics");
  same(succeeded.map((r) => r.number), Array.from({ length: rounds }, (_, i) => i + 1), "the API's succeeded rounds");
  check(all.some((r) => r.state === "failed" && r.number === 3), "round 3's first attempt failed (a device declined)");
  const expected = (field) => succeeded.filter((r) => typeof r.metrics[field] === "number").map((r) => r.number).join(",");
  const series = {
    train_loss: expected("train_loss"),
    federated_eval_accuracy: expected("federated_eval_accuracy"),
    central_eval_accuracy: expected("central_eval_accuracy"),
  };
  check(series.train_loss.split(",").length === rounds, `every round has a train loss: ${series.train_loss}`);
  check(series.federated_eval_accuracy.split(",").length >= rounds - 1,
    `devices evaluated (nearly) every version: ${series.federated_eval_accuracy}`);
  check(series.central_eval_accuracy.split(",").length >= rounds - 1,
    `the server evaluated (nearly) every version centrally: ${series.central_eval_accuracy}`);

  log("the curves: one point per finished round with data");
  const drawn = async () => page.$$eval("polyline[data-series]", (lines) => Object.fromEntries(lines.map((l) => [l.dataset.series, {
    rounds: l.dataset.rounds,
    vertices: l.getAttribute("points").trim() === "" ? 0 : l.getAttribute("points").trim().split(/\s+/).length,
    circles: l.parentNode.querySelectorAll("circle").length,
  }])));
  await eventually("the curves match the API", async () => {
    const now = await drawn();
    return { ok: Object.entries(series).every(([key, rounds]) => now[key] && now[key].rounds === rounds), value: now };
  });
  const final = await drawn();
  for (const [key, roundList] of Object.entries(series)) {
    const count = roundList === "" ? 0 : roundList.split(",").length;
    same([final[key].vertices, final[key].circles], [count, count], `${key}: vertices and markers`);
  }
  check(before < rounds, `the page was live: it showed ${before} rounds before the job ended with ${rounds}`);

  log("polls read only the newest page");
  const firstPolls = roundLists.filter((p) => !p.has("cursor"));
  check(firstPolls.length >= 4, `the page polled the rounds (${firstPolls.length} times)`);
  for (const params of firstPolls) {
    same([params.get("order"), params.get("limit")], ["newest", String(POLL_ROUNDS)], "a poll's rounds request");
  }
  const paged = roundLists.filter((p) => p.has("cursor"));
  check(paged.length <= 2, `older rounds are read once, not every poll (${paged.length} paged requests)`);
  check(POLL_ROUNDS < all.length, `the job has more rounds (${all.length}) than a poll reads`);

  log("rounds table: paging, a failed attempt and its drop reason");
  same(await page.$$eval("#rounds tbody tr", (rows) => rows.length), POLL_ROUNDS, "rows on the first page");
  await page.click("#rounds-older");
  same(await page.$$eval("#rounds tbody tr", (rows) => rows.length), all.length - POLL_ROUNDS, "rows on the last page");
  const failed = all.find((r) => r.state === "failed");
  await page.click(`#rounds tbody tr[data-key="${failed.id}"]`);
  await page.waitForFunction((reason) => document.getElementById("participants").textContent.includes(reason), declineReason);
  check((await page.textContent("#round-title")).includes("attempt 1"), "the failed attempt's detail is shown");
  same(failed.failure && failed.failure.kind, "too_few_updates", "the API's cause of the failed attempt");
  check((await page.textContent("#round-summary")).includes(`failed (too few updates): ${failed.failure.message}`),
    "the failed attempt's cause and message are shown");
  await page.screenshot({ path: join(artifacts, "round-detail-desktop.png"), fullPage: true });
  await page.click("#rounds-newer");
  await page.click(`#rounds tbody tr[data-key="${all[all.length - 1].id}"]`);
  await page.waitForFunction(() => document.getElementById("round-title").textContent.includes("the latest"));

  log("screenshots of the job");
  await page.screenshot({ path: join(artifacts, "dashboard-desktop.png"), fullPage: true });
  await narrow(page, "dashboard-420px.png");

  log("a secure job made with the form, then cancelled with its button");
  await page.click("#new-job summary");
  const documented = (await api("/api/v1/openapi.json")).components.schemas.StrategyName.enum;
  same(await page.$$eval('#job-form [name="strategy"] option', (options) => options.map((o) => o.value)),
    documented, "the form's strategies, as the OpenAPI document lists them");
  check(documented.includes("fedprox"), `the OpenAPI document lists fedprox: ${documented}`);
  await page.fill('#job-form [name="name"]', "secure-from-form");
  await page.fill('#job-form [name="model_version_id"]', String(modelVersionId));
  await page.fill('#job-form [name="rounds"]', "3");
  await page.fill('#job-form [name="min_devices"]', "3");
  await page.fill('#job-form [name="target_devices"]', "3");
  await page.check('#job-form [name="secure"]');
  await page.uncheck('#job-form [name="start"]');
  await page.click("#job-form button");
  const created = await eventually("the form's job", async () => {
    const jobs = await api("/api/v1/jobs?limit=100");
    const job = jobs.items.find((j) => j.name === "secure-from-form");
    return { ok: Boolean(job), value: job || jobs.items.map((j) => j.name) };
  });
  same([created.state, created.spec.secure_aggregation.enabled, created.spec.rounds], ["created", true, 3], "the form's job");
  await page.waitForFunction((id) => document.getElementById("job-title").textContent.startsWith(`Job ${id}:`), created.id);
  check(await page.isVisible("#job-secure"), "a secure job shows the secure marker");
  check(await page.$eval(`#jobs tr[data-key="${created.id}"] td:nth-child(2)`, (td) => td.classList.contains("secure-job")),
    "the jobs list marks the secure job");
  check(await page.$eval(`#jobs tr[data-key="${jobId}"] td:nth-child(2)`, (td) => !td.classList.contains("secure-job")),
    "the jobs list does not mark the plain job");
  check(await page.isEnabled('button[data-action="start"]') && await page.isDisabled('button[data-action="pause"]'),
    "a created job offers Start, not Pause");
  await page.screenshot({ path: join(artifacts, "secure-job-desktop.png"), fullPage: true });
  page.once("dialog", (dialog) => dialog.accept());
  await page.click('button[data-action="cancel"]');
  await eventually("the form's job cancelled", async () => {
    const job = await api(`/api/v1/jobs/${created.id}`);
    return { ok: job.state === "cancelled", value: job.state };
  });

  log("models: versions and the lineage graph");
  const versions = (await api("/api/v1/models/digits/versions?limit=500")).items;
  same(versions.length, rounds + 1, "the upload and one version per round");
  await page.click('#views button[data-view="models"]');
  await page.waitForFunction((count) => document.querySelectorAll("#lineage .node.chain").length === count, versions.length);
  same(await page.$$eval("#lineage .node", (nodes) => nodes.length), versions.length, "lineage nodes");
  same(await page.$$eval("#lineage .edge", (edges) => edges.length), versions.length - 1, "lineage edges");
  const latest = versions[versions.length - 1];
  const firstRow = await page.$eval("#versions tbody tr", (row) => [...row.cells].map((c) => c.textContent));
  same([firstRow[0], firstRow[2]], [String(latest.version), latest.digest.slice(0, 12) + "…"], "the newest version's row");
  const fifth = versions.find((v) => v.version === 5);
  await page.click(`#lineage .node[data-version-id="${fifth.id}"]`);
  const lineage = await api(`/api/v1/models/digits/versions/5/lineage`);
  await page.waitForFunction((count) => document.querySelectorAll("#lineage .node.chain").length === count, lineage.chain.length);
  same(lineage.chain.length, 5, "version 5's lineage");
  await page.screenshot({ path: join(artifacts, "lineage-desktop.png"), fullPage: true });
  await narrow(page, "lineage-420px.png");

  log("devices: online state, datasets and the last error");
  await page.click('#views button[data-view="devices"]');
  await page.waitForFunction(() => document.querySelectorAll("#devices tbody tr").length === 4);
  const devices = await page.textContent("#devices");
  check(devices.includes("permission denied"), "a device's last error is shown");
  check(/digits: \d+ × \[64\], 10 classes/.test(devices), `datasets are shown: ${devices}`);
  check(devices.includes("online"), "online devices are marked");
  await page.screenshot({ path: join(artifacts, "devices-desktop.png"), fullPage: true });
  await narrow(page, "devices-420px.png");

  check(problems.length === 0, "the page logged errors (a CSP violation shows here):\n" + problems.join("\n"));
  log("all checks passed; screenshots in " + artifacts);
}

/// A screenshot at 420 px, checking that the page itself does not scroll
/// sideways (wide tables scroll in their own box).
async function narrow(page, name) {
  await page.setViewportSize(NARROW);
  await page.waitForTimeout(400);
  const width = await page.evaluate(() => document.documentElement.scrollWidth);
  check(width <= NARROW.width, `at ${NARROW.width} px the page is ${width} px wide`);
  await page.screenshot({ path: join(artifacts, name), fullPage: true });
  await page.setViewportSize(DESKTOP);
  await page.waitForTimeout(300);
}

main().then(
  () => process.exit(0),
  (error) => {
    console.error(`[dashboard.spec] FAILED: ${error.stack || error}`);
    process.exit(1);
  },
);
