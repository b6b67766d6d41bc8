// The Canopy dashboard: reads the admin API with the token the user gives
// (kept in this tab's sessionStorage, or passed as #token=… in the URL,
// which browsers never send to the server). Values from the API are put in
// with textContent only, never as HTML.
"use strict";

const REFRESH_MS = 2000;
let selectedJob = null;

const tokenInput = document.getElementById("token");
const statusLine = document.getElementById("status");

function token() {
  return sessionStorage.getItem("canopy-token") || "";
}

async function api(path) {
  const response = await fetch(path, { headers: { Authorization: "Bearer " + token() } });
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const message = body && body.error ? body.error.message : response.statusText;
    throw new Error(path + ": " + response.status + " " + message);
  }
  return body;
}

function fill(tableId, rows, cells, onClick) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren();
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const value of cells(row)) {
      const td = document.createElement("td");
      td.textContent = value === null || value === undefined ? "–" : String(value);
      tr.appendChild(td);
    }
    if (onClick) {
      tr.classList.add("selectable");
      if (selectedJob === row.id) tr.classList.add("selected");
      tr.addEventListener("click", () => onClick(row));
    }
    body.appendChild(tr);
  }
}

const fixed = (value, digits) => (typeof value === "number" ? value.toFixed(digits) : value);
const ago = (ms) => Math.max(0, Math.round((Date.now() - ms) / 1000)) + " s ago";

async function refresh() {
  if (!token()) {
    statusLine.textContent = "enter a token (admin, operator or viewer)";
    return;
  }
  try {
    const jobs = await api("/api/v1/jobs?limit=100");
    if (selectedJob === null && jobs.items.length > 0) selectedJob = jobs.items[jobs.items.length - 1].id;
    fill("jobs", jobs.items, (j) => [j.id, j.name, j.state, j.rounds_completed + " / " + j.spec.rounds, j.status_message],
      (j) => { selectedJob = j.id; refresh(); });
    if (selectedJob !== null) {
      const rounds = await api("/api/v1/jobs/" + selectedJob + "/rounds?limit=100");
      document.getElementById("rounds-title").textContent = "Rounds of job " + selectedJob;
      fill("rounds", rounds.items, (r) => [r.number, r.attempt,
        r.secure_stage && r.state === "training" ? r.state + " (secure: " + r.secure_stage + ")" : r.state, r.metrics.updates_accepted + " / " + r.selected,
        fixed(r.metrics.train_loss, 4), fixed(r.metrics.eval_accuracy, 3), r.metrics.bytes_in, r.metrics.bytes_out,
        r.metrics.dropouts, r.durations.total_ms === null ? null : (r.durations.total_ms / 1000).toFixed(2)]);
    }
    const devices = await api("/api/v1/devices?limit=500");
    fill("devices", devices.items, (d) => [d.id, d.tier, d.backends.join(", "), d.revoked ? "revoked" : (d.online ? "online" : "offline"),
      ago(d.last_seen_ms), Object.entries(d.tags).map(([k, v]) => k + "=" + v).join(" ")]);
    statusLine.className = "";
    statusLine.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    statusLine.className = "error";
    statusLine.textContent = error.message;
  }
}

document.getElementById("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("canopy-token", tokenInput.value.trim());
  tokenInput.value = "";
  refresh();
});

const fragment = new URLSearchParams(location.hash.slice(1));
if (fragment.get("token")) {
  sessionStorage.setItem("canopy-token", fragment.get("token"));
  history.replaceState(null, "", location.pathname);
}
refresh();
setInterval(refresh, REFRESH_MS);
