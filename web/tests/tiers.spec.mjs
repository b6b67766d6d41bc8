// A tiered job's round in the dashboard, in Chromium through playwright-core
// (plain node, no test runner): under each aggregator's row, the sub-round
// it ran over its own end devices, with the reasons its devices dropped out.
// Started by server/tests/dashboard_browser.rs against a server whose job
// CANOPY_JOB_ID has finished one round through two aggregators that
// reported their sub-rounds (the first: 4 of 5 devices, one timed out; the
// second: 3 of 3); and an asynchronous job, CANOPY_ASYNC_JOB_ID, whose
// three buffers each made a version, drawn against time; and a private
// job, CANOPY_PRIVATE_JOB_ID, that stopped at its ε budget after two
// rounds.
//
// Exits non-zero with the first failed check. Screenshots go to
// CANOPY_ARTIFACTS.
import { check, env, launch } from "./browser.mjs";
import { mkdirSync } from "node:fs";
import { join } from "node:path";

const base = env("CANOPY_URL");
const token = env("CANOPY_TOKEN");
const jobId = Number(env("CANOPY_JOB_ID"));
const asyncJobId = Number(env("CANOPY_ASYNC_JOB_ID"));
const privateJobId = Number(env("CANOPY_PRIVATE_JOB_ID"));
const artifacts = env("CANOPY_ARTIFACTS");
const executablePath = env("CANOPY_CHROMIUM");

async function main() {
  mkdirSync(artifacts, { recursive: true });
  const browser = await launch(executablePath);
  try {
    const context = await browser.newContext({ ignoreHTTPSErrors: true, viewport: { width: 1280, height: 900 } });
    const page = await context.newPage();
    const problems = [];
    page.on("console", (message) => {
      if (message.type() === "error") problems.push(`console: ${message.text()}`);
    });
    page.on("pageerror", (error) => problems.push("page error: " + error.message));
    await page.goto(`${base}/dashboard#token=${encodeURIComponent(token)}&job=${jobId}`);
    await page.waitForFunction(() => document.body.dataset.session === "signed-in", null, { timeout: 15_000 });
    await page.waitForSelector("#rounds tbody tr", { timeout: 15_000 });
    if (await page.isHidden("#round-detail")) await page.click("#rounds tbody tr");
    await page.waitForFunction(() => document.querySelectorAll("#participants tr.sub-round").length === 2,
      null, { timeout: 15_000 });
    const rows = await page.$$eval("#participants tbody tr", (trs) =>
      trs.map((tr) => ({ sub: tr.classList.contains("sub-round"), text: tr.textContent })));
    // Each sub-round sits right under its aggregator's row.
    check(rows.length === 4 && !rows[0].sub && rows[1].sub && !rows[2].sub && rows[3].sub,
      `aggregator, its sub-round, aggregator, its sub-round: ${JSON.stringify(rows)}`);
    const subRounds = rows.filter((row) => row.sub).map((row) => row.text);
    check(subRounds.some((text) => text.includes("4 of 5 end devices uploaded (40 samples)") &&
      text.includes("1 dropped") && text.includes("1 × timeout: no update before the round's deadline")),
      `the first sub-round with its dropout's reason: ${JSON.stringify(subRounds)}`);
    check(subRounds.some((text) => text.includes("3 of 3 end devices uploaded (30 samples)") && text.includes("0 dropped")),
      `the second sub-round: ${JSON.stringify(subRounds)}`);
    const settings = await page.textContent("#job-settings");
    for (const expected of ["aggregators per round", "sub-round takes 3 to 5 end devices", "deadline 54.0 s"]) {
      check(settings.includes(expected), `settings show "${expected}": ${settings}`);
    }
    const summary = await page.textContent("#round-summary");
    check(summary.includes("through 2 aggregators: 7 of 8 end devices uploaded"), `the round's summary: ${summary}`);
    await page.screenshot({ path: join(artifacts, "tiered-round-desktop.png"), fullPage: true });
    await page.setViewportSize({ width: 420, height: 900 });
    await page.waitForTimeout(200);
    const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    check(overflow <= 1, `at 420 px the page does not scroll sideways (${overflow} px too wide)`);
    await page.screenshot({ path: join(artifacts, "tiered-round-420px.png"), fullPage: true });
    await page.setViewportSize({ width: 1280, height: 900 });
    check(await page.isHidden("#privacy-figure"), "a job without differential privacy has no ε chart");
    await asynchronousOverTime(page);
    await privacySpent(page);
    check(problems.length === 0, `no errors on the page: ${JSON.stringify(problems)}`);
    console.log("[tiers.spec] the tiered round's tree is shown");
  } finally {
    await browser.close();
  }
}

/// An asynchronous job's charts are versions over time: the x axis is
/// seconds since the job started, one point per buffer's version, and its
/// settings say how it buffers.
async function asynchronousOverTime(page) {
  // A new load: the dashboard reads its hash when the page loads.
  await page.goto("about:blank");
  await page.goto(`${base}/dashboard#token=${encodeURIComponent(token)}&job=${asyncJobId}`);
  const pointsShown = () => document.querySelector("#chart-loss polyline[data-series=train_loss]")
    ?.dataset.rounds.split(",").filter(Boolean).length;
  try {
    await page.waitForFunction((expected) => document.querySelector("#chart-loss polyline[data-series=train_loss]")
      ?.dataset.rounds.split(",").filter(Boolean).length === expected, 3, { timeout: 15_000 });
  } catch (error) {
    throw new Error(`the asynchronous job's loss chart shows ${await page.evaluate(pointsShown)} points, not 3: ` +
      (await page.textContent("#chart-loss")) + "; " + error.message);
  }
  const title = await page.textContent("#chart-loss .axis-title.x");
  check(title === "seconds since the job started", `the loss chart's x title: ${title}`);
  const seconds = await page.$eval("#chart-loss polyline[data-series=train_loss]",
    (line) => line.dataset.rounds.split(",").map(Number));
  check(seconds.every((x, i) => x >= 0 && x < 120 && (i === 0 || x >= seconds[i - 1])),
    `one point per version, at ascending seconds since the start: ${seconds}`);
  const marker = await page.textContent("#chart-loss circle title");
  check(/buffer 1's version at [0-9.]+ s/.test(marker), `a marker names its buffer and time: ${marker}`);
  const settings = await page.textContent("#job-settings");
  check(settings.includes("2 devices train at once; a version every update (at least 1"), `the settings: ${settings}`);
  const legend = await page.textContent("#chart-loss .legend");
  check(legend.includes("training loss (3 versions)"), `the legend counts versions: ${legend}`);
  const caption = await page.$eval("#chart-accuracy", (chart) => chart.closest("figure").querySelector("figcaption").textContent);
  check(caption === "Accuracy per version, over time", `the accuracy chart's caption: ${caption}`);
  await page.screenshot({ path: join(artifacts, "asynchronous-job.png"), fullPage: true });
}

/// A private job's ε after each round, below its budget's line, as the
/// API reports them.
async function privacySpent(page) {
  await page.goto("about:blank");
  await page.goto(`${base}/dashboard#token=${encodeURIComponent(token)}&job=${privateJobId}`);
  await page.waitForSelector("#privacy-figure:not([hidden]) polyline[data-series=epsilon]", { timeout: 15_000 });
  const response = await page.request.get(`${base}/api/v1/jobs/${privateJobId}/rounds`, {
    headers: { authorization: `Bearer ${token}` },
  });
  const spent = (await response.json()).items
    .filter((round) => round.state === "succeeded" && round.privacy && typeof round.privacy.epsilon === "number")
    .map((round) => round.privacy.epsilon);
  check(spent.length === 2 && spent[0] < spent[1], `the API's ε after each round: ${spent}`);
  const rounds = await page.$eval("#chart-privacy polyline[data-series=epsilon]", (line) => line.dataset.rounds);
  check(rounds === "1,2", `one ε point per round: ${rounds}`);
  const markers = await page.$$eval("#chart-privacy .s-epsilon circle title", (titles) => titles.map((t) => t.textContent));
  check(markers.length === 2 && markers[1].startsWith("ε spent, round 2: ") &&
    Math.abs(Number(markers[1].split(": ")[1]) - spent[1]) < 0.01 * spent[1],
    `the markers show the API's ε: ${markers} against ${spent}`);
  const budget = await page.$eval("#chart-privacy polyline[data-series=budget]", (line) => line.dataset.rounds);
  check(budget === "1,2", `the budget's line spans the rounds: ${budget}`);
  const note = await page.textContent("#privacy-note");
  check(note.includes("δ = 0.00001") && note.includes("noise added by the server") && note.includes("of a budget of") &&
    note.includes("stops before a round"),
    `the note names δ, the spend and the budget: ${note}`);
  await page.screenshot({ path: join(artifacts, "private-job.png"), fullPage: true });
}

main().catch((error) => {
  console.error(`[tiers.spec] ${error.stack ?? error}`);
  process.exit(1);
});
