// kvserve cache dashboard: polls /v1/cache/stats once a second and draws it. No dependencies.
"use strict";

const POLL_MS = 1000;
const KEY_STORAGE = "kvserve-dashboard-key";
const SVG_NS = "http://www.w3.org/2000/svg";
const POOL_PARTS = [
  ["in_use", "in use", "var(--in-use)"],
  ["pinned", "pinned", "var(--pinned)"],
  ["cached", "cached (evictable)", "var(--cached)"],
  ["free", "free", "var(--free)"],
];

const $ = (selector) => document.querySelector(selector);

function svgElement(name, attributes) {
  const element = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attributes)) element.setAttribute(k, String(v));
  return element;
}

function formatCount(n) {
  return n >= 1e6 ? (n / 1e6).toFixed(1) + "M" : n >= 1e4 ? (n / 1e3).toFixed(1) + "k" : String(n);
}

function formatAgo(seconds) {
  if (seconds < 1) return "now";
  if (seconds < 90) return Math.round(seconds) + " s ago";
  if (seconds < 5400) return Math.round(seconds / 60) + " min ago";
  return Math.round(seconds / 3600) + " h ago";
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function drawPool(pool) {
  const svg = $("#pool-usage svg");
  const legend = $("#pool-usage .legend");
  svg.replaceChildren();
  legend.replaceChildren();
  let x = 0;
  // A tenant's view has only its own parts (cached, pinned); the pool-wide ones are null.
  for (const [key, label, color] of POOL_PARTS) {
    const blocks = pool[key];
    if (blocks === null) continue;
    const width = pool.blocks ? (1000 * blocks) / pool.blocks : 0;
    svg.append(svgElement("rect", { x, y: 0, width, height: 36, fill: color }));
    x += width;
    const item = document.createElement("li");
    item.dataset.part = key;
    const swatch = document.createElement("i");
    swatch.style.background = color;
    item.append(swatch, `${label}: ${formatCount(blocks)} blocks`);
    legend.append(item);
  }
  const total = document.createElement("li");
  const evicted = pool.evicted === null ? "" : `, ${formatCount(pool.evicted)} evicted`;
  total.textContent = `${formatCount(pool.blocks)} blocks of ${pool.block_size} tokens${evicted}`;
  legend.append(total);
  for (const tier of pool.tiers) {
    const item = document.createElement("li");
    item.dataset.tier = tier.name;
    const gib = (bytes) => (bytes / 2 ** 30).toFixed(2) + " GiB";
    item.textContent =
      tier.blocks === null
        ? `${tier.name} tier: ${gib(tier.capacity_bytes)}`
        : `${tier.name} tier: ${formatCount(tier.blocks)} blocks, ${gib(tier.bytes_used)} of ${gib(tier.capacity_bytes)}`;
    legend.append(item);
  }
}

function drawHitRate(counters, history) {
  const rate = counters.hit_rate;
  const value = $("#hit-rate-value");
  value.textContent = (100 * rate).toFixed(1) + "%";
  $("#hit-rate").dataset.rate = String(rate);
  $("#saved-value").textContent = formatCount(counters.saved_prefill_tokens);
  $("#computed-value").textContent = formatCount(counters.prefill_tokens_computed);
  const svg = $("#hit-rate svg");
  svg.replaceChildren();
  if (history.length < 2) return;
  const t0 = history[0].time;
  const span = Math.max(history[history.length - 1].time - t0, 1);
  $("#chart-start").textContent = formatAgo(span);
  const points = [];
  for (let i = 1; i < history.length; i++) {
    const queries = history[i].cache_queries - history[i - 1].cache_queries;
    if (queries <= 0) continue;
    const hits = history[i].cache_hits - history[i - 1].cache_hits;
    points.push([(1000 * (history[i].time - t0)) / span, 150 - 140 * (hits / queries)]);
  }
  for (const y of [10, 80, 150]) {
    svg.append(svgElement("line", { x1: 0, x2: 1000, y1: y, y2: y, stroke: "#e3e7ec", "stroke-width": 1 }));
  }
  const width = Math.max(4, 1000 / history.length);
  for (const [x, y] of points) {
    svg.append(svgElement("rect", { x: x - width / 2, y, width, height: 150 - y, fill: "var(--cached)", opacity: 0.85 }));
  }
}

// Acceptance since start: "off" when the server never drafts, "—" until something was drafted. A tenant's
// view has no speculation (it comes from every tenant's traffic): the card stays hidden.
function drawSpeculation(speculation) {
  const card = $("#speculation");
  card.hidden = speculation === null;
  if (speculation === null) return;
  const off = speculation.method === "off";
  const rate = speculation.acceptance_rate;
  const length = speculation.mean_accepted_length;
  $("#speculation-method").textContent = off ? "(off)" : `(${speculation.method})`;
  $("#acceptance-value").textContent = off ? "off" : rate === null ? "—" : (100 * rate).toFixed(1) + "%";
  $("#accepted-length-value").textContent = off ? "off" : length === null ? "—" : length.toFixed(2);
  $("#drafts-value").textContent = `${formatCount(speculation.drafts)} (${formatCount(speculation.draft_tokens)})`;
  const rowCost = speculation.row_cost;
  $("#row-cost-value").textContent = off || rowCost === null ? "—" : rowCost.toFixed(2);
  card.dataset.rate = rate === null ? "" : String(rate);
}

// The hot prefixes as an indented tree: each under the longest listed prefix it extends, so that a shared
// system prompt is one trunk and the conversations over it its branches; siblings heaviest first.
function drawBranches(branches, now) {
  const body = $("#prefix-tree tbody");
  body.replaceChildren();
  const children = branches.map(() => []);
  const roots = [];
  branches.forEach((b, i) => (b.parent === null ? roots : children[b.parent]).push(i));
  // Hits through a prefix: matches that ended at it or at a listed prefix extending it.
  const through = branches.map(() => 0);
  const total = (i) => (through[i] = branches[i].hits + children[i].reduce((sum, c) => sum + total(c), 0));
  roots.forEach(total);
  const heaviestFirst = (x, y) => branches[y].tokens * through[y] - branches[x].tokens * through[x];
  const visit = (i, depth) => {
    const b = branches[i];
    const row = body.insertRow();
    row.dataset.depth = String(depth);
    const text = b.text === null ? "(hidden: --dashboard-show-text)" : b.text.replace(/\n/g, "↵ ");
    const prefix = cell(row, (depth ? "└ … " : "") + text, "text");
    prefix.style.paddingLeft = `${8 + 22 * depth}px`;
    cell(row, formatCount(b.tokens) + (b.start ? ` (+${formatCount(b.tokens - b.start)})` : ""));
    cell(row, formatCount(b.hits));
    cell(row, formatCount(through[i]));
    cell(row, b.last_hit ? formatAgo(now - b.last_hit) : "–");
    cell(row, b.namespace);
    children[i].sort(heaviestFirst).forEach((c) => visit(c, depth + 1));
  };
  roots.sort(heaviestFirst).forEach((r) => visit(r, 0));
  $("#prefix-tree .empty").hidden = branches.length > 0;
}

function drawRequests(requests, total) {
  const body = $("#requests tbody");
  body.replaceChildren();
  for (const r of requests) {
    const row = body.insertRow();
    cell(row, r.id);
    cell(row, r.status);
    cell(row, r.namespace);
    cell(row, formatCount(r.prompt_tokens));
    cell(row, r.cached_tokens === null ? "–" : formatCount(r.cached_tokens));
    cell(row, formatCount(r.generated_tokens));
    cell(row, r.ttft_s === null ? "–" : (1000 * r.ttft_s).toFixed(0) + " ms");
    cell(row, r.age_s.toFixed(1) + " s");
  }
  $("#requests-count").textContent = total > requests.length ? `(${requests.length} of ${total})` : `(${total})`;
  $("#requests .empty").hidden = total > 0;
}

// The caller's namespace's last misses, and how many of them each reason explains. The text around the
// position comes only from a server started with --dashboard-show-text.
function drawMisses(misses, now) {
  const counts = {};
  for (const m of misses) counts[m.reason] = (counts[m.reason] || 0) + 1;
  $("#miss-reasons").textContent = Object.entries(counts)
    .map(([reason, n]) => `${reason}: ${n}`)
    .join(" · ");
  const body = $("#misses tbody");
  body.replaceChildren();
  for (const m of misses) {
    const row = body.insertRow();
    cell(row, (now - m.time).toFixed(0) + " s");
    cell(row, m.reason);
    cell(row, formatCount(m.missed_tokens));
    cell(row, formatCount(m.cached_tokens));
    cell(row, m.part === null ? "–" : m.part);
    cell(row, m.position === null ? "–" : String(m.position));
    cell(row, m.before === null ? "–" : `${m.before} ‖ ${m.after}`);
  }
  $("#misses .empty").hidden = misses.length > 0;
}

function setStatus(text, error) {
  const status = $("#status");
  status.textContent = text;
  status.classList.toggle("error", Boolean(error));
}

async function poll() {
  const headers = {};
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = "Bearer " + key;
  try {
    const response = await fetch("/v1/cache/stats", { headers, cache: "no-store" });
    if (response.status === 401 || response.status === 403) {
      $("#key-form").hidden = false;
      setStatus("an API key is needed", true);
      return;
    }
    if (!response.ok) {
      setStatus(`the server answered ${response.status}`, true);
      return;
    }
    const stats = await response.json();
    $("#key-form").hidden = true;
    drawPool(stats.pool);
    drawHitRate(stats.counters, stats.history);
    drawSpeculation(stats.speculation);
    drawBranches(stats.branches, stats.time);
    drawRequests(stats.requests, stats.num_requests);
    drawMisses(stats.misses, stats.time);
    setStatus(`${stats.model} · updated ${new Date(stats.time * 1000).toLocaleTimeString()}`);
  } catch (error) {
    setStatus("cannot reach the server", true);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("#key-input").value);
  $("#key-input").value = "";
});

poll();
