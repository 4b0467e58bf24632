// gossiploco dashboard: draws the swarm state the server streams (/events) on plain canvases.
// Nothing is fetched from anywhere but this server.
"use strict";

const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf"];
// Each chart's data: which per-peer array (points: the measurements, traffic: the observer's byte counts) and
// which column of its rows (column 0 is the step).
const SERIES = {
  loss: ["points", 1], val_loss: ["points", 2], cd_l2: ["points", 3], cd_js: ["points", 4],
  mib_sent: ["traffic", 1], mib_rate: ["traffic", 3],
};
const PATH_COLORS = { direct: "#2ca02c", reverse: "#1f77b4", relayed: "#d62728" };
const SVG = "http://www.w3.org/2000/svg";

function color(i) { return COLORS[i % COLORS.length]; }

function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "";
  if (typeof value !== "number") return String(value);
  if (value !== 0 && (Math.abs(value) < 1e-3 || Math.abs(value) >= 1e5)) return value.toExponential(2);
  return value.toFixed(digits).replace(/\.?0+$/, "");
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function drawChart(canvas, peers) {
  const [source, index] = SERIES[canvas.dataset.series];
  const lines = peers.map(([id, p], i) => ({
    id, color: color(i),
    points: (p[source] || []).filter(row => row[index] !== null).map(row => [row[0], row[index]]),
  }));
  const all = lines.flatMap(l => l.points);
  canvas.dataset.points = String(all.length);
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, L = 56, R = 10, T = 10, B = 28;
  ctx.clearRect(0, 0, W, H);
  ctx.font = "11px sans-serif";
  ctx.fillStyle = "#666";
  if (!all.length) { ctx.fillText("no data yet", W / 2 - 30, H / 2); return; }
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5 * Math.abs(y0 || 1); y1 += 0.5 * Math.abs(y1 || 1); }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  ctx.strokeStyle = "#ccc";
  ctx.beginPath(); ctx.moveTo(L, T); ctx.lineTo(L, H - B); ctx.lineTo(W - R, H - B); ctx.stroke();
  for (let k = 0; k <= 4; k++) {
    const y = y0 + (y1 - y0) * k / 4;
    ctx.fillText(fmt(y, 3), 2, sy(y) + 4);
    const x = x0 + (x1 - x0) * k / 4;
    ctx.fillText(String(Math.round(x)), sx(x) - 8, H - B + 14);
  }
  ctx.fillText("step", W - R - 24, H - 4);
  for (const line of lines) {
    ctx.strokeStyle = line.color; ctx.fillStyle = line.color; ctx.lineWidth = 1.6;
    ctx.beginPath();
    line.points.forEach(([x, y], k) => (k ? ctx.lineTo(sx(x), sy(y)) : ctx.moveTo(sx(x), sy(y))));
    ctx.stroke();
    for (const [x, y] of line.points) { ctx.fillRect(sx(x) - 1.5, sy(y) - 1.5, 3, 3); }
  }
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

// The members on a circle, a line from each peer to each partner it reports a path to, coloured and labelled
// by the path's kind (direct, reverse, relayed). Departed peers are grey.
function drawLinks(figure, peers) {
  const W = 560, H = 320, cx = W / 2, cy = H / 2 - 6, radius = Math.min(W, H) / 2 - 40;
  const where = new Map(peers.map(([id], i) => {
    const angle = -Math.PI / 2 + 2 * Math.PI * i / Math.max(peers.length, 1);
    return [id, [cx + radius * Math.cos(angle), cy + radius * Math.sin(angle), i]];
  }));
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, id: "links-graph" });
  const seen = new Set();
  let links = 0;
  for (const [id, p] of peers) {
    for (const [partner, path] of Object.entries(p.paths)) {
      const key = [id, partner].sort().join("-");
      if (seen.has(key) || !where.has(partner)) continue;
      seen.add(key);
      links++;
      const [x1, y1] = where.get(id), [x2, y2] = where.get(partner);
      const stroke = PATH_COLORS[path] || "#7f7f7f";
      root.append(svg("line", { x1, y1, x2, y2, stroke, "stroke-width": 2, class: "link", "data-path": path }));
      root.append(svg("text", { x: (x1 + x2) / 2 + 4, y: (y1 + y2) / 2 - 4, fill: stroke, "font-size": 11 }, path));
    }
  }
  for (const [id, p] of peers) {
    const [x, y, i] = where.get(id);
    const fill = p.live ? color(i) : "#bbb";
    root.append(svg("circle", { cx: x, cy: y, r: 16, fill, class: "node", "data-peer": id }));
    root.append(svg("text", { x, y: y + 4, "text-anchor": "middle", fill: "#fff", "font-size": 11 }, id));
    root.append(svg("text", { x, y: y + 30, "text-anchor": "middle", fill: "#444", "font-size": 10 },
                    `r${p.round} ${bytes(p.rate)}/s`));
  }
  figure.dataset.links = String(links);
  figure.dataset.nodes = String(peers.length);
  figure.replaceChildren(root);
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function render(state) {
  const peers = Object.entries(state.peers);
  const live = peers.filter(([, p]) => p.live);
  const maxRound = Math.max(-1, ...live.map(([, p]) => p.round));
  const summary = document.getElementById("summary");
  const tokens = live.reduce((sum, [, p]) => sum + (p.tokens || 0), 0);
  summary.textContent = `${live.length} live peer(s), round ${maxRound}, ${tokens.toLocaleString("en")} tokens seen by the swarm`;
  summary.dataset.peers = String(live.length);
  summary.dataset.tokens = String(tokens);
  summary.dataset.round = String(maxRound);

  document.querySelectorAll("canvas.chart").forEach(c => drawChart(c, peers));
  drawLinks(document.getElementById("links"), peers);

  const legend = document.getElementById("legend");
  legend.replaceChildren(...peers.map(([id], i) => {
    const span = document.createElement("span");
    span.style.setProperty("--c", color(i));
    span.textContent = `peer ${id}`;
    return span;
  }));

  const body = document.querySelector("#peers tbody");
  const causes = [];
  body.replaceChildren(...peers.map(([id, p]) => {
    const tr = document.createElement("tr");
    tr.dataset.peer = id;
    tr.dataset.round = String(p.round);
    if (!p.live) tr.className = "gone";
    const failures = Object.entries(p.failures).map(([k, n]) => `${k} ${n}`).join(", ");
    const paths = Object.entries(p.paths).map(([k, v]) => `${k}: ${v}`).join(", ");
    for (const c of p.causes) causes.push(`peer ${id}, ${c}`);
    tr.append(cell(id), cell(p.run, "text"), cell(p.live ? "yes" : "gone"), cell(p.round), cell(p.h), cell(p.step),
              cell(p.members), cell(fmt(p.loss)), cell(fmt(p.val_loss)), cell(fmt(p.cd_l2)), cell(fmt(p.cd_js)),
              cell(p.mix2.join(" "), "text"), cell(bytes(p.bytes_sent)), cell(bytes(p.bytes_received)),
              cell(`${bytes(p.rate)}/s`), cell(p.utilization === null ? "" : `${(100 * p.utilization).toFixed(0)}%`),
              cell((p.tokens || 0).toLocaleString("en")),
              cell(failures, "text"), cell(paths, "text"));
    return tr;
  }));
  document.getElementById("causes").textContent = causes.length ? "Recent failures: " + causes.join("; ") : "";

  const config = document.getElementById("config");
  config.replaceChildren(...Object.entries(state.runs).map(([run, cfg]) => {
    const details = document.createElement("details");
    const title = document.createElement("summary");
    title.textContent = `run ${run}`;
    const pre = document.createElement("pre");
    pre.textContent = JSON.stringify(cfg, null, 2);
    details.append(title, pre);
    return details;
  }));
}

function connect() {
  const status = document.getElementById("connection");
  const source = new EventSource("/events");
  source.addEventListener("state", event => {
    status.textContent = "live"; status.className = "ok";
    render(JSON.parse(event.data));
  });
  source.onerror = () => { status.textContent = "reconnecting"; status.className = "bad"; };
}

connect();
