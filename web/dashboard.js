// The Canopy dashboard: reads the admin API with the token the user gives
// (kept in this tab's sessionStorage, or passed as #token=… in the URL,
// which browsers never send to the server). Values from the API are put in
// with textContent only, never as HTML. `#job=ID` opens a job.
//
// Polling is bounded however long a job runs: each poll asks for the
// newest page of rounds (`order=newest`), and older rounds are read once,
// newest first, up to HISTORY_ROUNDS, when a job is opened.
import { lineChart, lineageGraph } from "/dashboard-charts.js";

const POLL_MS = 2000;
/// Rounds each poll reads: the newest, where a running job changes.
const POLL_ROUNDS = 20;
/// Rounds per page when reading a job's history (the server's largest).
const HISTORY_PAGE = 100;
/// Rounds kept for the curves; a longer job shows its latest this many.
const HISTORY_ROUNDS = 5000;
/// Older rounds still open (or still being evaluated) re-read per poll.
const MAX_STALE_REFRESH = 5;
const TABLE_ROWS = 20;
const MAX_VERSIONS = 2000;
const OPEN_ROUND_STATES = new Set(["selecting", "training", "aggregating"]);

const state = {
  view: "jobs",
  jobs: [],
  jobId: null,
  job: null,
  /// Rounds of the open job by round id.
  rounds: new Map(),
  historyLoaded: false,
  historyTruncated: false,
  roundsPage: 0,
  roundId: null,
  roundFollowsLatest: true,
  round: null,
  models: [],
  modelName: null,
  versions: [],
  versionsPage: 0,
  versionId: null,
  lineage: null,
  devices: [],
};

const $ = (id) => document.getElementById(id);
const statusLine = $("status");

function token() {
  return sessionStorage.getItem("canopy-token") || "";
}

async function api(path, method = "GET", body) {
  const headers = { Authorization: "Bearer " + token() };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const answer = await response.json().catch(() => null);
  if (!response.ok) {
    const message = answer && answer.error ? answer.error.message : response.statusText;
    const error = new Error(`${method} ${path}: ${response.status} ${message}`);
    error.status = response.status;
    throw error;
  }
  return answer;
}

// ---- formatting ----

const dash = "–";
const fixed = (value, digits) => (typeof value === "number" ? value.toFixed(digits) : dash);
const ago = (ms) => {
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  return s < 120 ? s + " s ago" : s < 7200 ? Math.round(s / 60) + " min ago" : Math.round(s / 3600) + " h ago";
};
const when = (ms) => (typeof ms === "number" ? new Date(ms).toLocaleString() : dash);
function bytes(n) {
  if (typeof n !== "number") return dash;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? String(n) : n.toFixed(1)) + " " + units[i];
}
function duration(ms) {
  if (typeof ms !== "number") return dash;
  if (ms < 1000) return Math.round(ms) + " ms";
  if (ms < 120000) return (ms / 1000).toFixed(1) + " s";
  return Math.round(ms / 60000) + " min";
}

// ---- tables ----

/// A cell: a value, or { text, className, title }.
function cell(value) {
  const td = document.createElement("td");
  if (value !== null && typeof value === "object") {
    td.textContent = value.text ?? dash;
    if (value.className) td.className = value.className;
    if (value.title) td.title = value.title;
  } else {
    td.textContent = value === null || value === undefined || value === "" ? dash : String(value);
  }
  return td;
}

function fill(tableId, rows, cells, { selected, onClick, key } = {}) {
  const body = document.querySelector("#" + tableId + " tbody");
  const trs = rows.map((row) => {
    const tr = document.createElement("tr");
    tr.append(...cells(row).map(cell));
    if (key) tr.dataset.key = String(key(row));
    if (onClick) {
      tr.classList.add("selectable");
      tr.tabIndex = 0;
      tr.addEventListener("click", () => onClick(row));
      tr.addEventListener("keydown", (event) => { if (event.key === "Enter") onClick(row); });
    }
    if (selected && selected(row)) tr.classList.add("selected");
    return tr;
  });
  body.replaceChildren(...trs);
}

function badge(element, text, kind) {
  element.textContent = text;
  element.className = "badge state-" + kind;
}

// ---- jobs ----

const isSecure = (job) => Boolean(job.spec.secure_aggregation && job.spec.secure_aggregation.enabled);

async function refreshJobs() {
  const jobs = await api("/api/v1/jobs?limit=100");
  state.jobs = jobs.items;
  if (state.jobId === null && jobs.items.length > 0) selectJob(jobs.items[jobs.items.length - 1].id);
  renderJobList();
  if (state.jobId === null) return;
  state.job = jobs.items.find((j) => j.id === state.jobId) || (await api("/api/v1/jobs/" + state.jobId));
  await refreshRounds(state.jobId);
  await refreshRound();
  renderJob();
}

function renderJobList() {
  fill("jobs", state.jobs, (j) => [
    j.id,
    { text: j.name, className: isSecure(j) ? "secure-job" : "", title: isSecure(j) ? "secure aggregation (SecAgg+)" : "" },
    { text: j.state, className: "state-" + j.state },
    j.rounds_completed + " / " + j.spec.rounds,
  ], { selected: (j) => j.id === state.jobId, onClick: (j) => { selectJob(j.id); refresh(); }, key: (j) => j.id });
}

function selectJob(id) {
  if (state.jobId === id) return;
  state.jobId = id;
  state.job = null;
  state.rounds = new Map();
  state.historyLoaded = false;
  state.historyTruncated = false;
  state.roundsPage = 0;
  state.roundId = null;
  state.roundFollowsLatest = true;
  state.round = null;
  history.replaceState(null, "", "#job=" + id);
}

/// Reads the newest page of the job's rounds; on the first poll of a job
/// (or when more rounds finished between two polls than a page holds) it
/// pages on, newest first, until it meets rounds it has.
async function refreshRounds(jobId) {
  const known = new Set(state.rounds.keys());
  let page = await api(`/api/v1/jobs/${jobId}/rounds?order=newest&limit=${POLL_ROUNDS}`);
  if (state.jobId !== jobId) return;
  const seen = new Set(page.items.map((r) => r.id));
  merge(page.items);
  let overlaps = page.items.some((r) => known.has(r.id));
  while (page.next_cursor && !(overlaps && state.historyLoaded) && state.rounds.size < HISTORY_ROUNDS) {
    page = await api(`/api/v1/jobs/${jobId}/rounds?order=newest&limit=${HISTORY_PAGE}&cursor=${page.next_cursor}`);
    if (state.jobId !== jobId) return;
    page.items.forEach((r) => seen.add(r.id));
    merge(page.items);
    overlaps = overlaps || page.items.some((r) => known.has(r.id));
    renderJob();
  }
  if (!state.historyLoaded) {
    state.historyLoaded = true;
    state.historyTruncated = Boolean(page.next_cursor);
  }
  // Rounds past the newest page that may still change: still open, or
  // their version still being evaluated by devices.
  const stale = [...state.rounds.values()]
    .filter((r) => !seen.has(r.id) && (OPEN_ROUND_STATES.has(r.state) || r.metrics.federated_eval_state === "open"))
    .slice(0, MAX_STALE_REFRESH);
  for (const r of stale) merge([await api("/api/v1/rounds/" + r.id)]);
}

function merge(items) {
  for (const r of items) state.rounds.set(r.id, r);
  if (state.rounds.size > HISTORY_ROUNDS) {
    const oldest = [...state.rounds.keys()].sort((a, b) => a - b).slice(0, state.rounds.size - HISTORY_ROUNDS);
    oldest.forEach((id) => state.rounds.delete(id));
    state.historyTruncated = true;
  }
}

/// A round's attempt matters once there is more than one: a failed
/// attempt, or the one that followed it.
const showAttempt = (r) => r.attempt > 1 || r.state === "failed";

const roundsNewestFirst = () => [...state.rounds.values()].sort((a, b) => b.id - a.id);

async function refreshRound() {
  const latest = roundsNewestFirst()[0];
  if (state.roundFollowsLatest && latest) state.roundId = latest.id;
  if (state.roundId === null) { state.round = null; return; }
  const settled = state.round && state.round.id === state.roundId && !OPEN_ROUND_STATES.has(state.round.state)
    && state.round.metrics.federated_eval_state !== "open";
  if (!settled) state.round = await api("/api/v1/rounds/" + state.roundId);
}

function renderJob() {
  const job = state.job;
  $("job-panel").hidden = !job;
  if (!job) return;
  $("job-title").textContent = `Job ${job.id}: ${job.name}`;
  badge($("job-state"), job.state, job.state);
  $("job-secure").hidden = !isSecure(job);
  $("job-status").textContent = `${job.rounds_completed} of ${job.spec.rounds} rounds done` +
    (job.round_failures > 0 ? `, ${job.round_failures} failed attempts of the current round` : "") +
    (job.status_message ? ". " + job.status_message : "");
  for (const button of $("job-controls").querySelectorAll("button")) {
    const allowed = { start: ["created"], pause: ["running"], resume: ["paused"], cancel: ["created", "running", "paused"] };
    button.disabled = !allowed[button.dataset.action].includes(job.state);
  }
  const rounds = roundsNewestFirst();
  const current = rounds[0];
  const stage = $("job-secure-stage");
  stage.hidden = !(isSecure(job) && current);
  if (isSecure(job) && current) {
    stage.textContent = `Secure aggregation, round ${current.number} (${current.state}): stage ` +
      (current.secure_stage || "not started");
  }
  renderSettings(job);
  renderCharts(rounds, job);
  renderPrivacy(rounds, job);
  renderRoundsTable(rounds);
  renderRound();
}

function renderSettings(job) {
  const spec = job.spec;
  const strategy = spec.strategy || { name: "fedavg" };
  const params = (object, skip) => Object.entries(object || {}).filter(([k]) => k !== skip).map(([k, v]) => `${k} ${v}`).join(", ");
  const schedule = spec.learning_rate_schedule || { kind: "constant" };
  const evaluation = spec.evaluation || {};
  const secure = spec.secure_aggregation && spec.secure_aggregation.enabled ? spec.secure_aggregation : null;
  const filters = spec.filters || {};
  // A tiered job: its rounds select aggregators, each running a sub-round.
  const edges = spec.edges || null;
  const rows = [
    ["model version", `id ${spec.model_version_id} (now at id ${job.current_version_id})`],
    ["strategy", strategy.name + (params(strategy, "name") ? ` (${params(strategy, "name")})` : " (defaults)")],
    ["learning rate", `${spec.learning_rate}, schedule ${schedule.kind}` + (params(schedule, "kind") ? ` (${params(schedule, "kind")})` : "")],
    ...(spec.asynchronous ? [["asynchronous (FedBuff)",
      `${spec.asynchronous.concurrency} devices train at once; a version every ` +
      (spec.target_devices === 1 ? "update " : `${spec.target_devices} updates `) +
      `(at least ${spec.min_devices} by a buffer's deadline), updates at most ${spec.asynchronous.max_staleness} ` +
      `versions old, weighted (1 + staleness)^-${spec.asynchronous.staleness_exponent}`]]
      : [[edges ? "aggregators per round" : "devices per round",
        `${spec.min_devices} to ${spec.target_devices}, over-selection ${spec.over_selection}`]]),
    ...(edges ? [["edge tier", `each aggregator's sub-round takes ${edges.min_devices} to ${edges.target_devices} end devices, ` +
      `over-selection ${edges.over_selection}, deadline ${duration(edges.deadline_ms)}`]] : []),
    ["local training", `${spec.local_epochs} epochs, batch ${spec.batch_size}`],
    ["round deadline", duration(spec.round_deadline_ms) + `, up to ${spec.max_round_retries} retries`],
    ["dataset", spec.dataset || "each device's default"],
    ["evaluation", (evaluation.fraction > 0 && !edges
      ? `federated on ${evaluation.fraction * 100}% of eligible devices (at most ${evaluation.max_devices}), deadline ` +
        (evaluation.deadline_ms ? duration(evaluation.deadline_ms) : "the round's")
      : "no federated evaluation") +
      (evaluation.central_dataset ? `; central on dataset ${evaluation.central_dataset}` : "")],
    ["secure aggregation", secure
      ? `SecAgg+, dropouts up to ${secure.max_dropout_fraction}, corrupt up to ${secure.max_corrupt_fraction}, clip ${secure.clip}, ${secure.bits} bits`
      : "off"],
    ["device filter", [filters.tier && "tier " + filters.tier, (filters.backends || []).length && "backends " + filters.backends.join(", "),
      (filters.gpu_types || []).length && "GPU " + filters.gpu_types.join(" or "),
      Object.keys(filters.tags || {}).length && "tags " + Object.entries(filters.tags).map(([k, v]) => k + "=" + v).join(" ")]
      .filter(Boolean).join("; ") || "any device"],
    ["created", when(job.created_ms)],
    ["started", when(job.started_ms)],
    ["finished", when(job.finished_ms)],
  ];
  const list = $("job-settings");
  list.replaceChildren(...rows.flatMap(([term, value]) => {
    const dt = document.createElement("dt");
    dt.textContent = term;
    const dd = document.createElement("dd");
    dd.textContent = value;
    return [dt, dd];
  }));
}

/// One point per succeeded training round that has the value: a failed
/// attempt shares its number with the attempt that succeeded, and never
/// counts; the statistics round (0) trains nothing. An asynchronous
/// job's rounds are buffers, each a version, made as fast as updates
/// come: its points are versions over time, at the seconds since the job
/// started (`xAxis`).
function points(rounds, pick, job) {
  const overTime = Boolean(job && job.spec.asynchronous);
  return rounds
    .filter((r) => r.state === "succeeded" && r.kind !== "statistics" && typeof pick(r) === "number")
    .map((r) => overTime
      ? { x: Math.max(0, (r.finished_ms - (job.started_ms || r.created_ms)) / 1000), y: pick(r), name: `buffer ${r.number}'s version` }
      : { x: r.number, y: pick(r) })
    .sort((a, b) => a.x - b.x);
}

/// The x axis of a job's charts.
function xAxis(job) {
  return job.spec.asynchronous
    ? { title: "seconds since the job started", integers: false, per: "per version, over time", unit: ["version", "versions"] }
    : { title: "round", integers: true, per: "per round", unit: ["round", "rounds"] };
}

/// How a secure job's training loss differs: a plain round weights the
/// devices' losses by their sample counts, and under secure aggregation
/// the server never learns a device's count (it is inside the masked sum).
function lossNote(job) {
  return isSecure(job)
    ? "Secure aggregation: the server learns only each round's summed update, not how many samples each device " +
      "trained on, so a secure round's training loss is the plain mean of the devices' losses."
    : "";
}

function renderCharts(rounds, job) {
  const note = state.historyTruncated ? `latest ${HISTORY_ROUNDS} rounds` : "";
  const finishedRounds = points(rounds, () => 0).length;
  const x = xAxis(job);
  document.querySelectorAll(".chart-per").forEach((span) => { span.textContent = x.per; });
  const evaluation = job.spec.evaluation || {};
  const evaluated = evaluation.fraction > 0 || Boolean(evaluation.central_dataset);
  lineChart($("chart-loss"), {
    x,
    yTitle: "training loss",
    finishedRounds,
    missing: "a training loss yet",
    series: [{ key: "train_loss", name: "training loss", className: "s-loss", points: points(rounds, (r) => r.metrics.train_loss, job), note }],
  });
  const lossExplained = $("loss-note");
  lossExplained.textContent = lossNote(job);
  lossExplained.hidden = !lossExplained.textContent;
  lineChart($("chart-accuracy"), {
    x,
    yTitle: "accuracy",
    fit: [0, 1],
    finishedRounds,
    missing: evaluated ? "an evaluation result yet" : "an evaluation: the job evaluates no version (see its settings)",
    series: [
      {
        key: "federated_eval_accuracy", name: "federated acc", className: "s-federated",
        points: points(rounds, (r) => r.metrics.federated_eval_accuracy, job),
        note: ["devices' held-out data, the version the round produced", note].filter(Boolean).join("; "),
      },
      {
        key: "central_eval_accuracy", name: "central acc", className: "s-central",
        points: points(rounds, (r) => r.metrics.central_eval_accuracy, job),
        note: ["the server's held-out dataset", note].filter(Boolean).join("; "),
      },
    ],
  });
}

/// A private job's ε after each round, against its budget: the job stops
/// before a round that would pass the budget, so the curve never crosses
/// the budget's line. Hidden for a job without differential privacy.
function renderPrivacy(rounds, job) {
  const privacy = job.privacy;
  const figure = $("privacy-figure");
  figure.hidden = !job.spec.differential_privacy || !privacy;
  if (figure.hidden) return;
  const spent = points(rounds, (r) => r.privacy && r.privacy.epsilon, job);
  const budget = privacy.budget_epsilon;
  const series = [{ key: "epsilon", name: "ε spent", className: "s-epsilon", points: spent }];
  if (typeof budget === "number" && spent.length > 0) {
    series.push({
      key: "budget", name: "budget", className: "s-budget",
      points: spent.map((p) => ({ ...p, y: budget })),
    });
  }
  lineChart($("chart-privacy"), {
    x: xAxis(job),
    yTitle: "ε",
    fit: [0, typeof budget === "number" ? budget : 0],
    finishedRounds: points(rounds, () => 0).length,
    missing: "a round accounted for yet",
    series,
  });
  const spentNow = typeof privacy.epsilon === "number" ? fixed(privacy.epsilon, 3) : "nothing";
  $("privacy-note").textContent =
    `(ε, δ)-differential privacy at δ = ${privacy.delta}, noise added by ` +
    (privacy.noise_added_by === "devices" ? "the devices before masking" : "the server") +
    `: ${spentNow} spent so far` +
    (typeof budget === "number"
      ? `, of a budget of ${Number(budget.toPrecision(4))}; the job stops before a round that would pass it.`
      : "; no budget.");
}

function renderRoundsTable(rounds) {
  const pages = Math.max(1, Math.ceil(rounds.length / TABLE_ROWS));
  state.roundsPage = Math.min(state.roundsPage, pages - 1);
  const shown = rounds.slice(state.roundsPage * TABLE_ROWS, (state.roundsPage + 1) * TABLE_ROWS);
  $("rounds-title").textContent = state.roundsPage === 0 ? "Latest rounds" : "Earlier rounds";
  $("rounds-page").textContent = rounds.length === 0 ? "no rounds yet"
    : `${state.roundsPage * TABLE_ROWS + 1}–${state.roundsPage * TABLE_ROWS + shown.length} of ${rounds.length}` +
      (state.historyLoaded ? "" : " (loading older rounds…)");
  $("rounds-newer").disabled = state.roundsPage === 0;
  $("rounds-older").disabled = state.roundsPage >= pages - 1;
  fill("rounds", shown, (r) => [
    (showAttempt(r) ? `${r.number} (attempt ${r.attempt})` : `${r.number}`) +
      (r.kind === "statistics" ? " · input statistics" : ""),
    { text: r.state + (r.secure_stage && OPEN_ROUND_STATES.has(r.state) ? ` · ${r.secure_stage}` : "") +
        (r.failure ? ` · ${failureCause(r.failure)}` : ""),
      className: "state-" + r.state, title: r.failure ? r.failure.message : "" },
    `${r.metrics.updates_accepted} / ${r.selected}`,
    r.metrics.dropouts,
    { text: fixed(r.metrics.train_loss, 4), title: lossNote(state.job) },
    { text: fixed(r.metrics.federated_eval_accuracy, 3) + (r.metrics.federated_eval_state === "open" ? " …" : ""),
      title: `${r.metrics.federated_eval_devices} devices reported, ${r.metrics.federated_eval_dropouts} did not` },
    fixed(r.metrics.central_eval_accuracy, 3),
    { text: bytes(r.metrics.bytes_in), className: "nowrap" },
    { text: bytes(r.metrics.bytes_out), className: "nowrap" },
    { text: duration(r.durations.total_ms ?? (Date.now() - r.created_ms)), className: "nowrap" },
  ], {
    key: (r) => r.id,
    selected: (r) => r.id === state.roundId,
    onClick: (r) => {
      state.roundFollowsLatest = r.id === roundsNewestFirst()[0].id;
      state.roundId = r.id;
      state.round = null;
      refreshRound().then(renderJob).catch(showError);
    },
  });
}

/// A failed round's cause in words, from its stable kind
/// (`too_few_updates` → "too few updates").
const failureCause = (failure) => failure.kind.replaceAll("_", " ");

function renderRound() {
  const round = state.round;
  $("round-detail").hidden = !round;
  if (!round) return;
  const m = round.metrics, d = round.durations;
  $("round-title").textContent = `Round ${round.number}` + (showAttempt(round) ? `, attempt ${round.attempt}` : "") +
    ` (${round.state})` + (state.roundFollowsLatest ? ", the latest" : "");
  $("round-summary").textContent = [
    `${round.selected} selected, ${m.updates_accepted} updates (${m.samples} samples), ${m.dropouts} dropped`,
    `selecting ${duration(d.selecting_ms)}, training ${duration(d.training_ms)}, aggregating ${duration(d.aggregating_ms)}`,
    `mean device training ${duration(d.mean_device_training_ms)}`,
    `${bytes(m.bytes_in)} up, ${bytes(m.bytes_out)} down`,
    round.failure ? `failed (${failureCause(round.failure)}): ${round.failure.message}` : round.status_message,
  ].filter(Boolean).join(" · ");
  fill("participants", round.participants, (p) => [
    p.device_id,
    { text: p.state, className: "state-" + p.state },
    p.num_samples,
    { text: bytes(p.update_bytes), className: "nowrap" },
    fixed(p.train_loss, 4),
    duration(p.train_duration_ms),
    { text: p.drop_reason ?? "", className: p.drop_reason ? "reason" : "" },
  ], { key: (p) => p.device_id });
  showSubRounds(round.participants);
  const more = $("participants-more");
  more.hidden = !round.participants_next_cursor;
  more.textContent = `Showing the first ${round.participants.length} participants by device id.`;
}

/// A tiered round's tree: under each aggregator's row, the sub-round it
/// ran over its own end devices, as it reported it (the cloud never sees
/// those devices one by one).
function showSubRounds(participants) {
  const body = document.querySelector("#participants tbody");
  const columns = document.querySelectorAll("#participants thead th").length;
  for (const p of participants) {
    const s = p.sub_round;
    if (!s) continue;
    const row = body.querySelector(`tr[data-key="${p.device_id}"]`);
    if (!row) continue;
    const tr = document.createElement("tr");
    tr.className = "sub-round";
    tr.dataset.aggregator = String(p.device_id);
    const td = document.createElement("td");
    td.colSpan = columns;
    const summary = document.createElement("div");
    summary.className = "sub-round-summary";
    // A secure sub-round's weight stays inside the masked sum.
    const weight = s.samples == null ? "samples masked" : `${s.samples} samples`;
    summary.textContent = `└ sub-round: ${s.updates} of ${s.selected} end devices uploaded (${weight})` +
      ` · ${s.dropouts} dropped` + (s.ineligible ? ` · ${s.ineligible} ineligible` : "") +
      ` · ${bytes(s.bytes_in)} up, ${bytes(s.bytes_out)} down · ${duration(s.duration_ms)}`;
    td.append(summary);
    for (const reason of s.dropout_reasons ?? []) {
      const line = document.createElement("div");
      line.className = "sub-round-reason reason";
      line.textContent = `${reason.devices} × ${reason.reason}`;
      td.append(line);
    }
    tr.append(td);
    row.after(tr);
  }
  const tiers = participants.filter((p) => p.sub_round);
  if (tiers.length > 0) {
    const devices = tiers.reduce((n, p) => n + p.sub_round.selected, 0);
    const updates = tiers.reduce((n, p) => n + p.sub_round.updates, 0);
    $("round-summary").textContent += ` · through ${tiers.length} aggregators: ${updates} of ${devices} end devices uploaded`;
  }
}

async function jobAction(action) {
  const id = state.jobId;
  if (action === "cancel" && !confirm(`Cancel job ${id}? Its open round fails, and a cancelled job cannot be resumed.`)) return;
  try {
    await api(`/api/v1/jobs/${id}/${action}`, "POST");
    await refresh();
  } catch (error) {
    showError(error);
  }
}

/// The strategies a job may name, as the server's OpenAPI document lists
/// them (generated from its enum, so the form never lags behind it).
async function loadStrategies() {
  const response = await fetch("/api/v1/openapi.json");
  if (!response.ok) throw new Error(`GET /api/v1/openapi.json: ${response.status} ${response.statusText}`);
  const names = (await response.json()).components.schemas.StrategyName.enum;
  const select = $("strategy-names");
  select.replaceChildren(...names.map((name) => new Option(name, name)));
}

/// Shows (or, with null, clears) the create form's error beside its button.
function formError(message) {
  const line = $("job-form-error");
  line.textContent = message || "";
  line.hidden = !message;
}

async function createJob(event) {
  event.preventDefault();
  const form = event.target;
  formError(null);
  const value = (name) => form.elements[name].value.trim();
  const spec = {
    name: value("name"),
    model_version_id: Number(value("model_version_id")),
    rounds: Number(value("rounds")),
    min_devices: Number(value("min_devices")),
    target_devices: Number(value("target_devices")),
    round_deadline_ms: Math.round(Number(value("round_deadline_s")) * 1000),
    local_epochs: Number(value("local_epochs")),
    batch_size: Number(value("batch_size")),
    learning_rate: Number(value("learning_rate")),
  };
  if (value("strategy")) spec.strategy = { name: value("strategy") };
  if (value("dataset")) spec.dataset = value("dataset");
  if (form.elements.secure.checked) spec.secure_aggregation = { enabled: true };
  let job;
  try {
    job = await api("/api/v1/jobs", "POST", spec);
  } catch (error) {
    formError("The job was not created: " + error.message);
    return;
  }
  selectJob(job.id);
  try {
    if (form.elements.start.checked) await api(`/api/v1/jobs/${job.id}/start`, "POST");
    $("new-job").open = false;
  } catch (error) {
    formError(`Job ${job.id} was created but did not start: ${error.message}`);
  }
  await refresh();
}

// ---- models ----

async function refreshModels() {
  const models = await api("/api/v1/models?limit=500");
  state.models = models.items;
  if (state.modelName === null && models.items.length > 0) state.modelName = models.items[0].name;
  fill("models", state.models, (m) => [m.name, m.versions, when(m.created_ms)], {
    key: (m) => m.name,
    selected: (m) => m.name === state.modelName,
    onClick: (m) => { selectModel(m.name); refresh(); },
  });
  if (state.modelName === null) return;
  const model = state.models.find((m) => m.name === state.modelName);
  // Versions only change by growing: re-read them when the count moved.
  if (!model || model.versions !== state.versions.length) await loadVersions(state.modelName);
  if (state.versionId === null && state.versions.length > 0) state.versionId = state.versions[state.versions.length - 1].id;
  const version = state.versions.find((v) => v.id === state.versionId);
  if (version && (!state.lineage || state.lineage.versionId !== version.id)) {
    const lineage = await api(`/api/v1/models/${encodeURIComponent(version.model)}/versions/${version.version}/lineage`);
    state.lineage = { versionId: version.id, ...lineage };
  }
  renderModel();
}

/// Where a version came from, in words, rounds by their number in the
/// job (people count rounds so; the id is server-wide): "upload",
/// "job 3, round 7", "job 3, input statistics" (round 0), or "job 3,
/// before its first round" (the FedProx step a job derives).
function origin(v) {
  if (v.produced_by_job === null) return "upload";
  const round = v.produced_by_round_number;
  if (round === null || round === undefined) return `job ${v.produced_by_job}, before its first round`;
  return `job ${v.produced_by_job}, ` + (round === 0 ? "input statistics" : `round ${round}`);
}

/// The versions on the table's current page, newest first.
function versionsShown() {
  const newest = [...state.versions].reverse();
  const pages = Math.max(1, Math.ceil(newest.length / TABLE_ROWS));
  state.versionsPage = Math.min(state.versionsPage, pages - 1);
  return newest.slice(state.versionsPage * TABLE_ROWS, (state.versionsPage + 1) * TABLE_ROWS);
}

function selectModel(name) {
  if (state.modelName === name) return;
  state.modelName = name;
  state.versions = [];
  state.versionId = null;
  state.lineage = null;
  state.versionsPage = 0;
}

async function loadVersions(name) {
  const versions = [];
  let cursor = null;
  do {
    const page = await api(`/api/v1/models/${encodeURIComponent(name)}/versions?limit=500` + (cursor ? "&cursor=" + cursor : ""));
    versions.push(...page.items);
    cursor = page.next_cursor;
  } while (cursor && versions.length < MAX_VERSIONS);
  if (state.modelName === name) state.versions = versions;
}

function selectVersion(version) {
  state.versionId = version.id;
  state.lineage = null;
  refresh();
}

function renderModel() {
  $("model-panel").hidden = state.modelName === null;
  if (state.modelName === null) return;
  $("model-title").textContent = "Model " + state.modelName;
  const chain = state.lineage ? state.lineage.chain.map((v) => v.id) : [];
  const selected = state.versions.find((v) => v.id === state.versionId);
  $("lineage-summary").textContent = selected && state.lineage
    ? `Version ${selected.version} (${origin(selected)}): ${chain.length} versions back to ` +
      (state.lineage.truncated ? "the server's lineage limit" : "its upload") + ". Click a version to trace it."
    : "";
  lineageGraph($("lineage"), state.versions, { chain, selectedId: state.versionId, onSelect: selectVersion, origin });
  const shown = versionsShown();
  const total = state.versions.length;
  $("versions-page").textContent = `${state.versionsPage * TABLE_ROWS + 1}–${state.versionsPage * TABLE_ROWS + shown.length} of ${total}`;
  $("versions-newer").disabled = state.versionsPage === 0;
  $("versions-older").disabled = (state.versionsPage + 1) * TABLE_ROWS >= total;
  fill("versions", shown, (v) => [
    v.version,
    v.id,
    { text: v.digest.slice(0, 12) + "…", title: "sha256 " + v.digest, className: "mono" },
    { text: bytes(v.size_bytes), className: "nowrap" },
    v.parent_version_id === null ? "none" : { text: `v${v.parent_version ?? "?"}`, title: `version id ${v.parent_version_id}` },
    { text: origin(v), title: v.produced_by_round === null ? "" : `round id ${v.produced_by_round}` },
    v.trainable ? "yes" : { text: "no", title: v.untrainable_reason || "" },
    when(v.created_ms),
  ], { key: (v) => v.id, selected: (v) => v.id === state.versionId, onClick: selectVersion });
}

// ---- devices ----

async function refreshDevices() {
  const devices = await api("/api/v1/devices?limit=500");
  state.devices = devices.items;
  fill("devices", state.devices, (d) => {
    const online = d.revoked ? "revoked" : d.online ? "online" : "offline";
    return [
      d.id,
      { text: online, className: "state-" + online },
      d.tier,
      { text: d.backends.join(", ") + (d.gpu ? ` (${d.gpu.name}, ${d.gpu.api}, ${d.gpu.device_type})` : ""), title: d.gpu ? d.gpu.driver : "" },
      d.datasets.map((s) => `${s.name}: ${s.samples} × [${s.sample_shape.join("×")}], ${s.classes} classes`).join("; ") || "none reported",
      { text: d.last_error ?? "", className: d.last_error ? "reason" : "" },
      { text: ago(d.last_seen_ms), title: when(d.last_seen_ms) },
      Object.entries(d.tags).map(([k, v]) => k + "=" + v).join(" "),
    ];
  }, { key: (d) => d.id });
}

// ---- the loop ----

function showError(error) {
  statusLine.className = "error";
  statusLine.textContent = error.message;
  if (error.status === 401) showSession("refused");
}

/// The header's sign-in state: `signed-out` (no token: the token field),
/// `checking` (a token, no answer yet), `signed-in` (the server took the
/// token: a marker and Sign out instead of the field), or `refused` (the
/// server answered 401: the field again, saying so).
function showSession(session) {
  document.body.dataset.session = session;
  $("login").hidden = session === "signed-in" || session === "checking";
  $("session").hidden = !$("login").hidden;
  $("session-state").textContent = session === "checking" ? "Connecting…" : "Signed in";
  $("session-state").className = "session-" + session;
  $("token").placeholder = session === "refused" ? "refused: try another" : "cnpa_…";
  $("token").setAttribute("aria-invalid", String(session === "refused"));
}

let refreshing = null;
/// One refresh at a time; a call during one waits for it and runs again.
async function refresh() {
  while (refreshing) await refreshing;
  refreshing = (async () => {
    if (!token()) {
      showSession("signed-out");
      statusLine.className = "";
      statusLine.textContent = "enter a token (admin, operator or viewer)";
      return;
    }
    // A refused token is not tried again until the user enters one.
    if (document.body.dataset.session === "refused") return;
    if (document.body.dataset.session !== "signed-in") showSession("checking");
    try {
      if (state.view === "jobs") await refreshJobs();
      else if (state.view === "models") await refreshModels();
      else await refreshDevices();
      showSession("signed-in");
      statusLine.className = "";
      statusLine.textContent = "updated " + new Date().toLocaleTimeString();
      document.body.dataset.refreshed = String(Date.now());
    } catch (error) {
      showError(error);
    }
  })();
  try { await refreshing; } finally { refreshing = null; }
}

function showView(view) {
  state.view = view;
  for (const button of $("views").querySelectorAll("button")) {
    button.setAttribute("aria-pressed", String(button.dataset.view === view));
  }
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== "view-" + view;
  refresh();
}

async function loop() {
  await refresh();
  setTimeout(loop, POLL_MS);
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("canopy-token", $("token").value.trim());
  $("token").value = "";
  showSession("checking");
  refresh();
});
$("sign-out").addEventListener("click", () => {
  sessionStorage.removeItem("canopy-token");
  // A fresh page: nothing read with the old token stays on screen.
  location.replace(location.pathname);
});
$("views").addEventListener("click", (event) => {
  if (event.target.dataset.view) showView(event.target.dataset.view);
});
$("job-controls").addEventListener("click", (event) => {
  if (event.target.dataset.action) jobAction(event.target.dataset.action);
});
$("job-form").addEventListener("submit", createJob);
$("rounds-newer").addEventListener("click", () => { state.roundsPage--; renderJob(); });
$("rounds-older").addEventListener("click", () => { state.roundsPage++; renderJob(); });
$("versions-newer").addEventListener("click", () => { state.versionsPage--; renderModel(); });
$("versions-older").addEventListener("click", () => { state.versionsPage++; renderModel(); });
let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => { if (state.view === "jobs") renderJob(); else if (state.view === "models") renderModel(); }, 150);
});

const fragment = new URLSearchParams(location.hash.slice(1));
if (fragment.get("token")) sessionStorage.setItem("canopy-token", fragment.get("token"));
if (/^[0-9]{1,18}$/.test(fragment.get("job") || "")) selectJob(Number(fragment.get("job")));
else history.replaceState(null, "", location.pathname);
loadStrategies().catch(showError);
loop();
