// The dashboard in Chromium, driven by playwright-core (plain node, no test
// runner). Started by server/tests/dashboard_browser.rs against a server
// whose job CANOPY_JOB_ID is running with real devices; the devices hold
// one round until this script has paused and resumed the job and written
// CANOPY_RESUMED_FILE.
//
// Exits non-zero with the first failed check. Screenshots go to
// CANOPY_ARTIFACTS.
import { check, env, launch } from "./browser.mjs";
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";

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
  const browser = await launch(executablePath);
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
  await apiReference(context, api);

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
  await page.waitForFunction(() => document.body.dataset.session === "signed-in", null, { timeout: 15_000 });
  check(await page.isVisible("#session") && await page.isHidden("#login"),
    "signed in, the header shows the session instead of the token field");
  same(await page.textContent("#session-state"), "Signed in", "the session marker");

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

  log("the charts: axis titles, an accuracy axis fitted to the data");
  same(await page.textContent("#chart-loss .axis-title.y"), "training loss", "the loss chart's y title");
  same(await page.textContent("#chart-accuracy .axis-title.y"), "accuracy", "the accuracy chart's y title");
  same(await page.textContent("#chart-accuracy .axis-title.x"), "round", "the accuracy chart's x title");
  const accuracies = succeeded.flatMap((r) => [r.metrics.federated_eval_accuracy, r.metrics.central_eval_accuracy])
    .filter((a) => typeof a === "number");
  const [low, high] = await page.$eval("#chart-accuracy svg", (svg) => [Number(svg.dataset.yLow), Number(svg.dataset.yHigh)]);
  const [dataLow, dataHigh] = [Math.min(...accuracies), Math.max(...accuracies)];
  check(low <= dataLow && high >= dataHigh, `the accuracy axis ${low}–${high} holds the data ${dataLow}–${dataHigh}`);
  check(high - low <= dataHigh - dataLow + 0.35, `the accuracy axis ${low}–${high} fits the data ${dataLow}–${dataHigh}`);
  await chartFunctions(page);
  same(await page.$$eval("#rounds thead th", (ths) => ths.map((th) => th.textContent).filter((t) => /acc|loss/.test(t))),
    ["training loss", "federated acc", "central acc"], "the rounds table's metric names");
  check((await page.textContent("#chart-accuracy .legend")).includes("federated acc"), "the legend's name for federated evaluation");

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
  await page.fill('#job-form [name="model_version_id"]', "999999");
  const logged = problems.length;
  await page.click("#job-form button");
  await page.waitForSelector("#job-form-error:not([hidden])");
  const formError = await page.textContent("#job-form-error");
  check(/not created/.test(formError) && /404/.test(formError),
    `the form says why the job was not created: ${formError}`);
  const [buttonBox, errorBox, formBox] = await Promise.all(["#job-form button", "#job-form-error", "#job-form"]
    .map((selector) => page.$eval(selector, (e) => e.getBoundingClientRect().toJSON())));
  check(errorBox.top >= buttonBox.bottom && errorBox.top - buttonBox.bottom < 24 && errorBox.bottom <= formBox.bottom + 1,
    `the form's error sits under its button: button ${JSON.stringify(buttonBox)}, error ${JSON.stringify(errorBox)}`);
  check(!(await page.getAttribute("#status", "class") || "").includes("error"), "the form's error is not (only) in the header");
  await page.screenshot({ path: join(artifacts, "form-error-desktop.png"), fullPage: true });
  // Chromium logs the refused request itself as an error: that one is expected.
  const refused = (problem) => problem.includes("status of 404") && problem.includes("/api/v1/jobs)");
  problems.push(...problems.splice(logged).filter((problem) => !refused(problem)));
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
  check(await page.isHidden("#job-form-error"), "a job created with the form clears the form's error");
  const looks = await page.$$eval("#job-controls button", (buttons) => buttons.map((b) => {
    const style = getComputedStyle(b);
    return { action: b.dataset.action, disabled: b.disabled, color: style.color, background: style.backgroundColor,
      border: style.borderStyle, opacity: style.opacity };
  }));
  const disabled = looks.find((b) => b.action === "pause"), enabled = looks.find((b) => b.action === "start");
  same([disabled.disabled, enabled.disabled], [true, false], "Pause is disabled and Start enabled");
  check(disabled.opacity === "1" && contrast(disabled.color, disabled.background) >= 3,
    `a disabled button stays legible: ${JSON.stringify(disabled)}`);
  check(disabled.background !== enabled.background && disabled.border !== enabled.border,
    `a disabled button looks unlike an enabled one: ${JSON.stringify([disabled, enabled])}`);
  check((await page.textContent("#loss-note")).includes("Secure aggregation") && await page.isVisible("#loss-note"),
    "a secure job says why its loss can trail its rounds");
  await jobsListFits(page, "desktop");
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
  const numberOf = (roundId) => all.find((r) => r.id === roundId).number;
  same(firstRow[5], `job ${jobId}, round ${numberOf(latest.produced_by_round)}`, "the newest version's origin, by round number");
  same(numberOf(latest.produced_by_round), rounds, "the newest version came from the last round");
  same(firstRow[4], "v" + versions.find((v) => v.id === latest.parent_version_id).version, "the newest version's parent, by number");
  const fifth = versions.find((v) => v.version === 5);
  await page.click(`#lineage .node[data-version-id="${fifth.id}"]`);
  const lineage = await api(`/api/v1/models/digits/versions/5/lineage`);
  await page.waitForFunction((count) => document.querySelectorAll("#lineage .node.chain").length === count, lineage.chain.length);
  same(lineage.chain.length, 5, "version 5's lineage");
  const summary = await page.textContent("#lineage-summary");
  check(summary.includes(`Version 5 (job ${jobId}, round ${numberOf(fifth.produced_by_round)})`),
    `the lineage names version 5's round by number: ${summary}`);
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
async function narrow(page, name, fullPage = true) {
  await page.setViewportSize(NARROW);
  await page.waitForTimeout(400);
  const width = await page.evaluate(() => document.documentElement.scrollWidth);
  check(width <= NARROW.width, `at ${NARROW.width} px the page is ${width} px wide`);
  await page.screenshot({ path: join(artifacts, name), fullPage });
  await page.setViewportSize(DESKTOP);
  await page.waitForTimeout(300);
}

/// WCAG's contrast ratio of two computed CSS colours ("rgb(r, g, b)").
function contrast(foreground, background) {
  const luminance = (css) => {
    const [r, g, b] = css.match(/[\d.]+/g).slice(0, 3).map((v) => {
      const c = Number(v) / 255;
      return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const [a, b] = [luminance(foreground), luminance(background)].sort((x, y) => y - x);
  return (a + 0.05) / (b + 0.05);
}

/// The jobs list shows every column inside its box: the rounds column is
/// not pushed out of view by a long name or the secure marker.
async function jobsListFits(page, where) {
  const boxes = await page.$eval("#jobs", (table) => {
    const box = table.parentElement;
    const frame = box.getBoundingClientRect();
    return {
      scrollWidth: box.scrollWidth, clientWidth: box.clientWidth, frameRight: frame.right,
      rounds: [...table.querySelectorAll("tbody tr")].map((tr) => ({ text: tr.cells[3].textContent, right: tr.cells[3].getBoundingClientRect().right })),
    };
  });
  check(boxes.rounds.length >= 2, `the jobs list has both jobs (${where})`);
  check(boxes.scrollWidth <= boxes.clientWidth, `the jobs list does not scroll sideways (${where}): ${JSON.stringify(boxes)}`);
  for (const cell of boxes.rounds) {
    check(cell.right <= boxes.frameRight + 0.5, `the rounds cell "${cell.text}" is inside the list (${where}): ${JSON.stringify(boxes)}`);
  }
}

/// The chart module on its own, with the data of a fine-tuning job
/// (accuracies just under 1) and of rounds that finished without a value.
async function chartFunctions(page) {
  const result = await page.evaluate(async () => {
    const { lineChart } = await import("/dashboard-charts.js");
    const box = document.createElement("div");
    box.className = "chart";
    document.body.append(box);
    const accuracies = [0.962, 0.968, 0.975, 0.979, 0.981];
    lineChart(box, {
      yTitle: "accuracy", fit: [0, 1], finishedRounds: 5,
      series: [{ key: "a", name: "a", className: "s-federated", points: accuracies.map((y, i) => ({ x: i + 1, y })) }],
    });
    const svg = box.querySelector("svg");
    const plot = box.querySelector("rect.plot").getBBox();
    const ys = box.querySelector("polyline").getAttribute("points").trim().split(/\s+/).map((p) => Number(p.split(",")[1]));
    const fitted = { low: Number(svg.dataset.yLow), high: Number(svg.dataset.yHigh), plotHeight: plot.height,
      top: Math.min(...ys), bottom: Math.max(...ys) };
    lineChart(box, { yTitle: "training loss", finishedRounds: 5, missing: "a training loss yet", series: [{ key: "l", name: "l", className: "s-loss", points: [] }] });
    const lines = () => [...box.querySelectorAll(".empty tspan")].map((t) => t.textContent).join(" ");
    const emptyAfterRounds = lines();
    lineChart(box, { yTitle: "training loss", finishedRounds: 0, series: [{ key: "l", name: "l", className: "s-loss", points: [] }] });
    const emptyBeforeRounds = lines();
    box.remove();
    return { fitted, emptyAfterRounds, emptyBeforeRounds };
  });
  const { fitted } = result;
  check(fitted.low < 0.962 && fitted.low >= 0.85 && fitted.high >= 0.981 && fitted.high <= 1,
    `accuracies 0.962–0.981 get an axis that fits them: ${JSON.stringify(fitted)}`);
  check(fitted.bottom - fitted.top > fitted.plotHeight * 0.2 && fitted.top > fitted.plotHeight * 0.05,
    `accuracies near 1 spread over the plot, not flat along its top: ${JSON.stringify(fitted)}`);
  same(result.emptyAfterRounds, "5 rounds finished, none with a training loss yet", "an empty chart after five finished rounds");
  same(result.emptyBeforeRounds, "no finished round yet", "an empty chart before any round finished");
}

/// The API reference page: the whole OpenAPI document, drawn by the
/// server's own script under the same strict policy.
async function apiReference(context, api) {
  log("the API reference page");
  const doc = await api("/api/v1/openapi.json");
  const page = await context.newPage();
  const problems = [];
  page.on("console", (message) => {
    if (message.type() === "error") problems.push(`console: ${message.text()} (${message.location().url})`);
  });
  page.on("pageerror", (error) => problems.push("page error: " + error.message));
  const response = await page.goto(`${base}/api/v1/docs`);
  for (const [path, policy] of [["/api/v1/docs", response.headers()["content-security-policy"]],
    ...await Promise.all(["/api-docs.js", "/api-docs.css"].map(async (path) =>
      [path, (await context.request.get(base + path)).headers()["content-security-policy"]]))]) {
    check(policy && policy.includes("default-src 'self'") && !/unsafe-|\*|https?:/.test(policy), `${path}'s policy: ${policy}`);
  }
  await page.waitForFunction(() => document.body.dataset.rendered, null, { timeout: 15_000 });
  same(await page.evaluate(() => document.body.dataset.rendered), "true", "the reference rendered");

  const resolve = (schema) => {
    while (schema && schema.$ref) schema = doc.components.schemas[schema.$ref.split("/").pop()];
    return schema;
  };
  /// An object schema's field names, through `$ref` and `allOf`.
  const fieldsOf = (schema) => {
    schema = resolve(schema);
    return [...Object.keys(schema.properties || {}), ...(schema.allOf || []).flatMap(fieldsOf)];
  };
  const create = doc.paths["/api/v1/jobs"].post;
  const body = create.requestBody.content["application/json"];
  same(body.schema.$ref, "#/components/schemas/JobSpec", "POST /api/v1/jobs takes a JobSpec");
  const operation = 'section.operation[data-method="post"][data-path="/api/v1/jobs"]';
  const request = `${operation} .request-body .media[data-schema="JobSpec"]`;
  const shownFields = await page.$$eval(`${request} > details > .fields > .scroll > table > tbody > tr`, (rows) => rows.map((r) => r.dataset.field));
  same(shownFields, Object.keys(resolve(body.schema).properties), "the JobSpec fields shown for POST /api/v1/jobs");
  for (const field of ["name", "model_version_id", "rounds", "strategy"]) {
    check(await page.isVisible(`${request} tr[data-field="${field}"]`), `the request body's field ${field} is visible`);
  }
  const roundsRow = await page.textContent(`${request} tr[data-field="rounds"]`);
  check(roundsRow.includes("required") && roundsRow.includes(String(resolve(body.schema).properties.rounds.maximum)),
    `the rounds field says it is required and its bound: ${roundsRow}`);
  const example = JSON.parse(await page.textContent(`${request} figure.example pre`));
  same(example, body.example, "the request body's example, as the document gives it");

  const created = Object.keys(create.responses).find((status) => status.startsWith("2"));
  const answer = create.responses[created].content["application/json"].schema;
  const response201 = `${operation} .response[data-status="${created}"]`;
  const answerFields = await page.$$eval(`${response201} tr[data-field]`, (rows) => rows.map((r) => r.dataset.field));
  for (const field of fieldsOf(answer)) check(answerFields.includes(field), `the ${created} response shows ${field}: ${answerFields}`);
  check(await page.isVisible(`${response201} tr[data-field="state"]`), `the ${created} response body is visible`);
  const statuses = await page.$$eval(`${operation} .response`, (all) => all.map((r) => r.dataset.status));
  same(statuses, Object.keys(create.responses), "every response of POST /api/v1/jobs");

  const methods = ["get", "put", "post", "patch", "delete", "head", "options", "trace"];
  const operations = Object.values(doc.paths).flatMap((item) => Object.keys(item).filter((k) => methods.includes(k)));
  const links = await page.$$eval('#toc a[href^="#op-"]', (as) => as.map((a) => [a.getAttribute("href"), Boolean(document.getElementById(a.getAttribute("href").slice(1)))]));
  same(links.length, operations.length, "the table of contents lists every operation");
  check(links.every(([, target]) => target), `every contents link has its target: ${JSON.stringify(links.filter(([, t]) => !t))}`);
  const tagged = new Set(Object.values(doc.paths).flatMap((item) => methods.filter((m) => item[m]).map((m) => item[m].tags[0])));
  for (const tag of tagged) check(await page.isVisible(`#toc a[href="#tag-${tag}"]`), `the contents list the tag ${tag}`);
  same(await page.$$eval("section.schema", (all) => all.length), Object.keys(doc.components.schemas).length, "a section per schema");
  same(await page.$$eval(".broken", (all) => all.map((e) => e.textContent)), [], "every $ref resolves");

  check((await page.$$eval("#overview code", (all) => all.map((c) => c.textContent))).includes("Authorization: Bearer TOKEN"),
    "the description's `Authorization: Bearer TOKEN` is code");
  const literal = await page.evaluate(() => {
    const walker = document.createTreeWalker(document.getElementById("reference"), NodeFilter.SHOW_TEXT);
    const found = [];
    while (walker.nextNode()) {
      const node = walker.currentNode;
      if (node.textContent.includes("`") && !node.parentElement.closest("pre, code")) found.push(node.textContent);
    }
    return found;
  });
  same(literal, [], "Markdown backticks left as text");
  const rendered = await page.evaluate(async () => {
    const { markdown } = await import("/api-docs.js");
    const box = document.createElement("div");
    box.append(markdown("Takes `x` and **y** <img src=x onerror=alert(1)> [a](javascript:alert(1)) [b](/dashboard).\n\n- one\n- two `z`"));
    return { html: box.innerHTML, images: box.querySelectorAll("img").length, links: [...box.querySelectorAll("a")].map((a) => a.getAttribute("href")) };
  });
  same(rendered, {
    html: "<p>Takes <code>x</code> and <strong>y</strong> &lt;img src=x onerror=alert(1)&gt; [a](javascript:alert(1)) <a href=\"/dashboard\">b</a>.</p>" +
      "<ul><li>one</li><li>two <code>z</code></li></ul>",
    images: 0, links: ["/dashboard"],
  }, "Markdown renders code, emphasis, lists and safe links, and leaves HTML as text");

  await page.click(`#toc a[href="#${await page.$eval(operation, (s) => s.id)}"]`);
  await page.waitForTimeout(200);
  check(await page.$eval(operation, (s) => Math.abs(s.getBoundingClientRect().top) < 40), "the contents link scrolls to POST /api/v1/jobs");
  await page.screenshot({ path: join(artifacts, "api-reference-create-job.png") });
  await page.goto(`${base}/api/v1/docs`);
  await page.waitForFunction(() => document.body.dataset.rendered === "true");
  await page.screenshot({ path: join(artifacts, "api-reference-top.png") });
  await narrow(page, "api-reference-420px.png", false);
  check(problems.length === 0, "the reference page logged errors (a CSP violation shows here):\n" + problems.join("\n"));
  await page.close();
}

main().then(
  () => process.exit(0),
  (error) => {
    console.error(`[dashboard.spec] FAILED: ${error.stack || error}`);
    process.exit(1);
  },
);
