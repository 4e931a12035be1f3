/* Quire's /dashboard: polls /metrics, parses the Prometheus text here in the browser, and
 * draws one uPlot chart per panel plus the "Latest values" table. Each row of the table
 * carries data-key and data-value (the number, "" when there is none), which is what the
 * charts plot at their newest point: the tests compare them with /metrics.
 *
 * Query parameters: interval=SECONDS between polls (default 2; 0: only on Refresh),
 * model=NAME to show that model first.
 *
 * Gauges and totals are the last poll's; rates and percentiles cover the interval
 * between the last two polls (a percentile is interpolated in the histogram's buckets
 * as PromQL's histogram_quantile does). With several models served, the selector shows
 * one model, or all with each engine's series named by its model.
 */
"use strict";
(function () {
  const params = new URLSearchParams(location.search);
  const intervalS = params.has("interval") ? Number(params.get("interval")) : 2;
  const HISTORY = 300; // points kept per chart
  const QUANTILES = [50, 95, 99];
  const ALL = "(all models)";
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  // panel id -> title and unit, in page order
  const PANELS = [
    ["requests", "Requests running / waiting, per engine", "sequences"],
    ["kv", "KV cache use, per engine", "share of pages (1 = full)"],
    ["prefix", "Prefix-cache hit rate over the interval, per engine", "hits / lookups"],
    ["ttft", "Time to first token over the interval", "seconds"],
    ["itl", "Inter-token latency over the interval", "seconds"],
    ["tokens", "Tokens per second", "tokens/s"],
    ["processes", "Live processes by role", "processes"],
    ["slo", "End-to-end p95 and SLO misses over the interval", "seconds, misses/s"],
    ["ttft_bands", "TTFT p95 by prompt length, over the interval", "seconds"],
    ["queue_bands", "Queue time p95 by prompt length, over the interval", "seconds"],
  ];

  // -- the Prometheus text format (0.0.4) -------------------------------------------------
  function number(text) {
    if (text === "+Inf" || text === "Inf") return Infinity;
    if (text === "-Inf") return -Infinity;
    return Number(text); // "NaN" too
  }

  function parseLabels(text) { // text: what is between the braces
    const labels = {};
    let i = 0;
    while (i < text.length) {
      const eq = text.indexOf("=", i);
      const name = text.slice(i, eq).trim();
      i = eq + 2; // past ="
      let value = "";
      while (text[i] !== '"') {
        if (text[i] === "\\") {
          const c = text[i + 1];
          value += c === "n" ? "\n" : c;
          i += 2;
        } else {
          value += text[i++];
        }
      }
      labels[name] = value;
      i += 1;
      while (i < text.length && (text[i] === "," || text[i] === " ")) i++;
    }
    return labels;
  }

  const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$/;

  function parseText(text) {
    const samples = [];
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const m = SAMPLE.exec(line);
      if (m) samples.push({ name: m[1], labels: m[2] ? parseLabels(m[2]) : {}, value: number(m[3]) });
    }
    return samples;
  }

  // -- figures of one model (or all) -------------------------------------------------------
  function ofModel(scrape, name, model) {
    return scrape.samples.filter((s) => s.name === name
      && (model === ALL || s.labels.model === undefined || s.labels.model === model));
  }

  // name -> {key -> value}, samples of one key summed; the key is the label's value
  // (prefixed by the model when all are shown)
  function byLabel(scrape, name, model, label) {
    const out = new Map();
    for (const s of ofModel(scrape, name, model)) {
      const own = `${label}="${s.labels[label]}"`;
      const key = model === ALL ? `model="${s.labels.model}",${own}` : own;
      out.set(key, (out.get(key) || 0) + s.value);
    }
    return out;
  }

  function total(scrape, name, model) {
    return ofModel(scrape, name, model).reduce((sum, s) => sum + s.value, 0);
  }

  function increase(cur, prev, name, model) {
    if (!prev) return null;
    const d = total(cur, name, model) - total(prev, name, model);
    return d >= 0 ? d : null; // a restart resets counters
  }

  // cumulative bucket counts over the interval, every series but "le" (and "group", when
  // given) summed: group value -> [[le, count]] sorted by le; bounds as the newest poll
  function bucketIncrease(cur, prev, name, model, group) {
    const sum = (scrape) => {
      const by = new Map();
      for (const s of ofModel(scrape, name + "_bucket", model)) {
        const g = group ? s.labels[group] : "";
        if (!by.has(g)) by.set(g, new Map());
        const le = number(s.labels.le);
        by.get(g).set(le, (by.get(g).get(le) || 0) + s.value);
      }
      return by;
    };
    const now = sum(cur), before = prev ? sum(prev) : new Map();
    const out = new Map();
    for (const g of [...now.keys()].sort((a, b) => Number(a) - Number(b))) {
      const was = before.get(g) || new Map();
      out.set(g, [...now.get(g).keys()].sort((a, b) => a - b)
        .map((le) => [le, now.get(g).get(le) - (was.get(le) || 0)]));
    }
    return out;
  }

  // PromQL's histogram_quantile over [upper bound, cumulative count] pairs
  function quantile(q, buckets) {
    if (buckets.length < 2 || buckets[buckets.length - 1][0] !== Infinity) return null;
    const observations = buckets[buckets.length - 1][1];
    if (!(observations > 0)) return null;
    let rank = q * observations;
    let b = buckets.findIndex(([, count], i) => i < buckets.length - 1 && count >= rank);
    if (b < 0) return buckets[buckets.length - 2][0]; // in the +Inf bucket
    if (b === 0 && buckets[0][0] <= 0) return buckets[0][0];
    const start = b === 0 ? 0 : buckets[b - 1][0];
    const below = b === 0 ? 0 : buckets[b - 1][1];
    const count = buckets[b][1] - below;
    rank -= below;
    return start + (buckets[b][0] - start) * (rank / count);
  }

  // the rows of the table, [key, value or null, panel id or null], in order
  function figures(cur, prev, model) {
    const rows = [];
    const dt = prev ? cur.t - prev.t : 0;
    const gauge = (prefix, name, label, panel) => {
      for (const [key, v] of byLabel(cur, name, model, label)) rows.push([`${prefix}{${key}}`, v, panel]);
    };
    gauge("running", "quire:num_requests_running", "engine", "requests");
    gauge("waiting", "quire:num_requests_waiting", "engine", "requests");
    gauge("kv_cache_usage", "quire:kv_cache_usage_perc", "engine", "kv");
    const hits = byLabel(cur, "quire:prefix_cache_hits_total", model, "engine");
    const lookups = byLabel(cur, "quire:prefix_cache_queries_total", model, "engine");
    const hitsBefore = prev ? byLabel(prev, "quire:prefix_cache_hits_total", model, "engine") : null;
    const lookupsBefore = prev ? byLabel(prev, "quire:prefix_cache_queries_total", model, "engine") : null;
    for (const [key, q] of lookups) {
      let rate = null;
      if (prev && lookupsBefore.has(key)) {
        const dq = q - lookupsBefore.get(key);
        const dh = (hits.get(key) || 0) - (hitsBefore.get(key) || 0);
        rate = dq > 0 ? dh / dq : null;
      }
      rows.push([`prefix_hit_rate{${key}}`, rate, "prefix"]);
    }
    for (const [hist, panel] of [["quire:time_to_first_token_seconds", "ttft"],
      ["quire:inter_token_latency_seconds", "itl"]]) {
      const buckets = (prev && bucketIncrease(cur, prev, hist, model).get("")) || [];
      for (const q of QUANTILES) rows.push([`${panel}_p${q}`, quantile(q / 100, buckets), panel]);
    }
    for (const kind of ["prompt", "generation"]) {
      const name = `quire:${kind}_tokens_total`;
      const d = increase(cur, prev, name, model);
      rows.push([`${kind}_tokens_per_s`, d === null || !(dt > 0) ? null : d / dt, "tokens"]);
      rows.push([`${kind}_tokens_total`, total(cur, name, model), null]);
    }
    gauge("processes", "quire:processes", "role", "processes");
    const e2e = (prev && bucketIncrease(cur, prev, "quire:e2e_request_latency_seconds", model).get("")) || [];
    rows.push(["e2e_p95", quantile(0.95, e2e), "slo"]);
    const missed = byLabel(cur, "quire:request_slo_missed_total", model, "slo");
    const missedBefore = prev ? byLabel(prev, "quire:request_slo_missed_total", model, "slo") : null;
    for (const [key, v] of missed) {
      const d = prev && missedBefore.has(key) ? v - missedBefore.get(key) : null;
      rows.push([`slo_missed_per_s{${key}}`, d === null || d < 0 || !(dt > 0) ? null : d / dt, "slo"]);
      rows.push([`slo_missed_total{${key}}`, v, null]);
    }
    // by prompt-length band: how the longest prompts fare
    for (const [hist, prefix, panel] of [
      ["quire:time_to_first_token_by_prompt_len_seconds", "ttft_p95", "ttft_bands"],
      ["quire:request_queue_time_by_prompt_len_seconds", "queue_p95", "queue_bands"]]) {
      for (const [band, buckets] of bucketIncrease(cur, prev, hist, model, "prompt_len_le")) {
        rows.push([`${prefix}{prompt_len_le="${band}"}`, prev ? quantile(0.95, buckets) : null, panel]);
      }
    }
    return rows;
  }

  // -- the page ----------------------------------------------------------------------------
  const state = { polls: 0, prev: null, cur: null, model: params.get("model"), charts: {}, inFlight: null };
  const select = document.getElementById("model");
  const status = document.getElementById("status");

  function show(v) {
    if (v === null || !Number.isFinite(v)) return "–";
    return Math.abs(v) >= 100 || Number.isInteger(v) ? String(Math.round(v * 100) / 100) : v.toPrecision(4);
  }

  function fillTable(rows) {
    const body = document.querySelector("#latest tbody");
    body.replaceChildren(...rows.map(([key, v]) => {
      const tr = document.createElement("tr");
      tr.dataset.key = key;
      tr.dataset.value = v === null || !Number.isFinite(v) ? "" : String(v);
      const name = document.createElement("td");
      name.textContent = key;
      const value = document.createElement("td");
      value.className = "v";
      value.textContent = show(v);
      tr.append(name, value);
      return tr;
    }));
  }

  function panelBox(id, title) {
    let box = document.getElementById(`panel-${id}`);
    if (!box) {
      box = document.createElement("div");
      box.className = "panel";
      box.id = `panel-${id}`;
      const h = document.createElement("h3");
      h.textContent = title;
      const plot = document.createElement("div");
      plot.className = "plot";
      box.append(h, plot);
      document.getElementById("charts").append(box);
    }
    return box.querySelector(".plot");
  }

  function draw(t, rows) {
    for (const [id, title, unit] of PANELS) {
      const mine = rows.filter((r) => r[2] === id);
      const chart = state.charts[id] || (state.charts[id] = { keys: [], times: [], cols: [], plot: null });
      const keys = mine.map((r) => r[0]);
      if (keys.join("\n") !== chart.keys.join("\n")) { // new series: carry known ones over
        const old = new Map(chart.keys.map((k, i) => [k, chart.cols[i]]));
        chart.cols = keys.map((k) => old.get(k) || chart.times.map(() => null));
        chart.keys = keys;
        if (chart.plot) chart.plot.destroy();
        chart.plot = null;
      }
      chart.times.push(t);
      mine.forEach((r, i) => chart.cols[i].push(r[1] === null || !Number.isFinite(r[1]) ? null : r[1]));
      if (chart.times.length > HISTORY) {
        chart.times.shift();
        chart.cols.forEach((c) => c.shift());
      }
      const data = [chart.times, ...chart.cols];
      const target = panelBox(id, title);
      if (!chart.plot) {
        target.replaceChildren();
        chart.plot = new uPlot({
          width: Math.max(300, target.clientWidth || 440), height: 200,
          scales: { x: { time: true } },
          axes: [{}, { label: unit, size: 60 }],
          series: [{}, ...keys.map((k, i) => ({ label: k, stroke: COLORS[i % COLORS.length], width: 1.5 }))],
        }, data, target);
      } else {
        chart.plot.setData(data);
      }
    }
  }

  function chooseModel(models) {
    const options = models.length > 1 ? [...models, ALL] : models;
    if (state.model === null || !options.includes(state.model)) state.model = options[0] || ALL;
    const have = [...select.options].map((o) => o.value);
    if (have.join("\n") !== options.join("\n")) {
      select.replaceChildren(...options.map((m) => new Option(m, m)));
    }
    select.value = state.model;
  }

  function resetCharts() {
    for (const chart of Object.values(state.charts)) if (chart.plot) chart.plot.destroy();
    state.charts = {};
    document.getElementById("charts").replaceChildren();
  }

  function render() {
    const rows = figures(state.cur, state.prev, state.model);
    fillTable(rows);
    draw(state.cur.t, rows);
    document.body.dataset.polls = String(state.polls);
    document.body.dataset.interval = state.prev ? String(state.cur.t - state.prev.t) : "";
    document.body.dataset.model = state.model;
  }

  async function pollOnce() {
    try {
      const resp = await fetch("metrics", { cache: "no-store" });
      if (!resp.ok) throw new Error(`/metrics answered ${resp.status}`);
      const text = await resp.text();
      const scrape = { t: Date.now() / 1000, samples: parseText(text) };
      state.prev = state.cur;
      state.cur = scrape;
      state.polls += 1;
      const models = [...new Set(scrape.samples.map((s) => s.labels.model).filter((m) => m !== undefined))].sort();
      chooseModel(models);
      render();
      status.textContent = `polled ${new Date().toLocaleTimeString()}`;
      status.className = "";
    } catch (err) {
      status.textContent = String(err);
      status.className = "error";
    }
  }

  function poll() { // one poll at a time: a click during a poll waits for it
    if (!state.inFlight) state.inFlight = pollOnce().finally(() => { state.inFlight = null; });
    return state.inFlight;
  }

  async function loop() {
    await poll();
    if (intervalS > 0) setTimeout(loop, intervalS * 1000);
  }

  select.addEventListener("change", () => {
    state.model = select.value;
    resetCharts();
    if (state.cur) render();
  });
  document.getElementById("refresh").addEventListener("click", () => { poll(); });
  document.getElementById("every").textContent = intervalS > 0 ? `every ${intervalS} s` : "on Refresh only";
  window.quireDashboard = { poll, state, parseText, quantile };
  loop();
})();
