// SVG drawing for the dashboard: line charts of per-round metrics and a
// model's lineage graph. Our own code rather than a library: two small
// pictures, no dependency to vendor and keep current, and everything is
// built with DOM calls (no markup strings), so the page's content security
// policy needs no 'unsafe-inline' and API values are never parsed as HTML.
// Colours and strokes come from classes in dashboard.css.

const SVG = "http://www.w3.org/2000/svg";
/// Past this many points a series is drawn as a line alone: a thousand
/// circles with tooltips cost more than they tell.
const MAX_MARKERS = 150;

function svg(tag, attributes, parent) {
  const element = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes || {})) element.setAttribute(name, String(value));
  if (parent) parent.appendChild(element);
  return element;
}

function text(x, y, content, className, parent) {
  const element = svg("text", { x, y, class: className }, parent);
  element.textContent = content;
  return element;
}

/// The step between about `count` ticks over `span`: 1, 2 or 5 times a
/// power of ten.
function tickStep(span, count) {
  const raw = span / Math.max(1, count);
  const power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
}

/// About `count` round values from `low` to `high`, at 1, 2 or 5 times a
/// power of ten apart.
function ticks(low, high, count, integers) {
  if (!(high > low)) return [low];
  let step = tickStep(high - low, count);
  if (integers) step = Math.max(1, Math.round(step));
  const out = [];
  for (let value = Math.ceil(low / step) * step; value <= high + step * 1e-9; value += step) {
    out.push(Number(value.toFixed(10)));
  }
  return out;
}

function label(value) {
  if (Number.isInteger(value)) return String(value);
  return Math.abs(value) >= 100 ? value.toFixed(0) : String(Number(value.toPrecision(3)));
}

/// The y range of a chart: `fit` ([low, high] bounds, e.g. [0, 1] for an
/// accuracy) fits the range to the data with some room either side, so
/// that accuracies between 0.97 and 0.99 fill the plot instead of drawing
/// flat along its top; without `fit` the range runs from 0 (or the lowest
/// value, if negative) to the first tick at or above the highest value.
export function yRange(values, fit) {
  if (values.length === 0) return fit ? [...fit] : [0, 1];
  let low = Math.min(...values), high = Math.max(...values);
  if (!fit) {
    low = Math.min(0, low);
    if (!(high > low)) return [low, low + 1];
    // Up to the next tick, so the highest point is not on the frame.
    const step = tickStep(high - low, 8);
    return [low, Number((Math.ceil(high / step - 1e-9) * step).toFixed(10))];
  }
  const [floor, ceiling] = fit;
  // Room of a tenth of the spread, and at least 2% of the bounds, so a
  // flat series sits inside the plot rather than on its edge.
  const room = Math.max((high - low) * 0.1, (ceiling - floor) * 0.02);
  low = Math.max(floor, low - room);
  high = Math.min(ceiling, high + room);
  // Round outwards to the ticks' step, so the axis ends on a labelled value.
  const step = tickStep(high - low, 8);
  low = Math.max(floor, Math.floor(low / step - 1e-9) * step);
  high = Math.min(ceiling, Math.ceil(high / step + 1e-9) * step);
  return [Number(low.toFixed(10)), Number(high.toFixed(10))];
}

/// What an empty chart says, as lines: no round finished, or rounds
/// finished without this value (`missing` names it).
export function emptyText(finishedRounds, missing) {
  if (!(finishedRounds > 0)) return ["no finished round yet"];
  const rounds = finishedRounds === 1 ? "1 round finished," : `${finishedRounds} rounds finished,`;
  return [rounds, `none with ${missing || "this value"}`];
}

/// Draws a line chart into `container`, replacing what was there.
///
/// `series`: [{ key, name, className, points: [{ x, y, name? }] }], x
/// ascending. Each series is one <polyline data-series=KEY
/// data-rounds="1,2,…"> with one vertex per point, so a test (or a
/// curious user) can read exactly which rounds (or, over time, which
/// seconds) it shows. `x`: the x axis, { title, integers, unit: [one,
/// many] } (rounds when left out); a point's `name` labels its marker. `yTitle`: the y axis's title. `fit`: bounds
/// for a range fitted to the data (see `yRange`). `finishedRounds` and
/// `missing`: what an empty chart says (see `emptyText`). The <svg>
/// carries its y range as data-y-low and data-y-high.
export function lineChart(container, { series, x = { title: "round", integers: true, unit: ["round", "rounds"] }, yTitle, fit, finishedRounds, missing }) {
  const width = Math.max(260, Math.floor(container.clientWidth || 600));
  const height = 210;
  const margin = { left: 60, right: 12, top: 12, bottom: 42 };
  const all = series.flatMap((s) => s.points);
  const [yLow, yHigh] = yRange(all.map((p) => p.y), fit);
  const root = svg("svg", {
    width, height, viewBox: `0 0 ${width} ${height}`, role: "img", class: "line-chart",
    "data-y-low": yLow, "data-y-high": yHigh,
  });
  const plotW = width - margin.left - margin.right;
  const plotH = height - margin.top - margin.bottom;
  const frame = svg("g", { transform: `translate(${margin.left},${margin.top})` }, root);
  svg("rect", { x: 0, y: 0, width: plotW, height: plotH, class: "plot" }, frame);

  let xLow = 1, xHigh = 1;
  if (all.length > 0) {
    xLow = Math.min(...all.map((p) => p.x));
    xHigh = Math.max(...all.map((p) => p.x));
  }
  if (xHigh === xLow) { xLow -= 0.5; xHigh += 0.5; }
  const sx = (x) => ((x - xLow) / (xHigh - xLow)) * plotW;
  const sy = (y) => plotH - ((y - yLow) / (yHigh - yLow)) * plotH;

  for (const value of all.length === 0 ? [] : ticks(yLow, yHigh, 4, false)) {
    svg("line", { x1: 0, x2: plotW, y1: sy(value), y2: sy(value), class: "grid" }, frame);
    text(-6, sy(value) + 4, label(value), "tick y", frame);
  }
  const xCount = Math.max(2, Math.floor(plotW / 60));
  const xTicks = x.integers ? ticks(Math.ceil(xLow), Math.floor(xHigh), xCount, true) : ticks(xLow, xHigh, xCount, false);
  for (const value of all.length === 0 ? [] : xTicks) {
    svg("line", { x1: sx(value), x2: sx(value), y1: plotH, y2: plotH + 4, class: "axis" }, frame);
    text(sx(value), plotH + 16, label(value), "tick x", frame);
  }
  svg("line", { x1: 0, x2: plotW, y1: plotH, y2: plotH, class: "axis" }, frame);
  text(plotW / 2, plotH + 32, x.title, "axis-title x", frame);
  if (yTitle) {
    const title = text(0, 0, yTitle, "axis-title y", frame);
    title.setAttribute("transform", `translate(${14 - margin.left},${plotH / 2}) rotate(-90)`);
  }

  if (all.length === 0) {
    const message = svg("text", { x: plotW / 2, y: plotH / 2, class: "empty" }, frame);
    emptyText(finishedRounds, missing).forEach((line, index) => {
      svg("tspan", { x: plotW / 2, dy: index === 0 ? 0 : "1.3em" }, message).textContent = line;
    });
  }
  for (const s of series) {
    const group = svg("g", { class: "series " + s.className }, frame);
    const line = svg("polyline", {
      points: s.points.map((p) => `${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join(" "),
      "data-series": s.key,
      "data-rounds": s.points.map((p) => p.x).join(","),
    }, group);
    svg("title", {}, line).textContent = s.name;
    if (s.points.length <= MAX_MARKERS) {
      for (const p of s.points) {
        const dot = svg("circle", { cx: sx(p.x), cy: sy(p.y), r: 3 }, group);
        const where = p.name ? `${p.name} at ${label(p.x)} s` : `round ${p.x}`;
        svg("title", {}, dot).textContent = `${s.name}, ${where}: ${label(p.y)}`;
      }
    }
  }
  container.replaceChildren(root, legend(series, x.unit));
}

/// `unit`: what a point is, singular and plural.
function legend(series, [one, many]) {
  const list = document.createElement("ul");
  list.className = "legend";
  for (const s of series) {
    const item = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.className = "swatch " + s.className;
    item.append(swatch, `${s.name} (${s.points.length} ${s.points.length === 1 ? one : many})`);
    if (s.note) {
      const note = document.createElement("span");
      note.className = "muted";
      note.textContent = " " + s.note;
      item.append(note);
    }
    list.appendChild(item);
  }
  return list;
}

/// Draws a model's versions as a graph, parent to child, left to right:
/// the column is the distance from a root (an uploaded version), the row
/// a branch. `chain`: ids of the selected version's lineage, drawn
/// highlighted. `onSelect(version)` is called when a node is clicked;
/// `origin(version)` says where a version came from ("job 3, round 7").
export function lineageGraph(container, versions, { chain, selectedId, onSelect, origin }) {
  const byId = new Map(versions.map((v) => [v.id, v]));
  const children = new Map();
  const roots = [];
  for (const v of [...versions].sort((a, b) => a.id - b.id)) {
    if (v.parent_version_id !== null && byId.has(v.parent_version_id)) {
      if (!children.has(v.parent_version_id)) children.set(v.parent_version_id, []);
      children.get(v.parent_version_id).push(v);
    } else {
      roots.push(v);
    }
  }
  // Iterative depth-first layout (a 1,000-round job is a chain 1,000 deep):
  // a node takes its first child's row, and every later child a new row.
  const place = new Map();
  let rows = 0;
  for (const root of roots) {
    const stack = [{ v: root, depth: 0, row: rows++ }];
    while (stack.length > 0) {
      const { v, depth, row } = stack.pop();
      place.set(v.id, { depth, row });
      const kids = children.get(v.id) || [];
      for (let i = kids.length - 1; i >= 0; i--) {
        stack.push({ v: kids[i], depth: depth + 1, row: i === 0 ? row : rows++ });
      }
    }
  }
  const onChain = new Set(chain || []);
  const stepX = 56, stepY = 44, pad = 24;
  const maxDepth = Math.max(0, ...[...place.values()].map((p) => p.depth));
  const width = pad * 2 + maxDepth * stepX + 20;
  const height = pad * 2 + Math.max(0, rows - 1) * stepY + 12;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", class: "lineage-graph" });
  const at = (id) => {
    const p = place.get(id);
    return { x: pad + p.depth * stepX, y: pad + p.row * stepY };
  };
  for (const v of versions) {
    if (v.parent_version_id === null || !place.has(v.parent_version_id)) continue;
    const from = at(v.parent_version_id), to = at(v.id);
    const highlighted = onChain.has(v.id) && onChain.has(v.parent_version_id);
    const d = from.y === to.y
      ? `M${from.x},${from.y} L${to.x},${to.y}`
      : `M${from.x},${from.y} C${from.x + stepX / 2},${from.y} ${to.x - stepX / 2},${to.y} ${to.x},${to.y}`;
    svg("path", { d, class: highlighted ? "edge chain" : "edge" }, root);
  }
  for (const v of versions) {
    const { x, y } = at(v.id);
    const classes = ["node"];
    if (onChain.has(v.id)) classes.push("chain");
    if (v.id === selectedId) classes.push("selected");
    if (v.produced_by_job === null) classes.push("upload");
    const node = svg("g", { class: classes.join(" "), "data-version-id": v.id, tabindex: 0 }, root);
    svg("circle", { cx: x, cy: y, r: 9 }, node);
    text(x, y + 24, "v" + v.version, "node-label", node);
    const from = origin ? origin(v) : v.produced_by_job === null ? "upload" : `job ${v.produced_by_job}`;
    svg("title", {}, node).textContent =
      `version ${v.version} (id ${v.id}), ${from}, parent ` +
      (v.parent_version_id === null ? "none" : `v${v.parent_version ?? "?"} (id ${v.parent_version_id})`) + `, sha256 ${v.digest}`;
    if (onSelect) {
      node.addEventListener("click", () => onSelect(v));
      node.addEventListener("keydown", (event) => { if (event.key === "Enter") onSelect(v); });
    }
  }
  container.replaceChildren(root);
}
