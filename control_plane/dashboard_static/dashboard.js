// inferlb's dashboard: renders the control plane's /dashboard/events feed (SSE) and acts through /v1.
// No framework: uPlot (vendored) draws the time series, a canvas the heat map. No inline script (CSP).
"use strict";

(() => {
  const TOKEN_KEY = "inferlb-admin-token";
  const MAX_POINTS = 300;
  const HEAT_MIN_COLUMNS = 60;  // a young history is drawn over a minute's width, not squeezed to the edge
  const $ = (id) => document.getElementById(id);
  const state = { points: [], snapshot: null, charts: {}, rows: new Map(), policyDirty: false, retryMs: 2000 };

  // --- formatting -----------------------------------------------------------------------------------
  const num = (x, digits = 1) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));
  const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(0)}%`);
  const ms = (s) => (s === null || s === undefined ? "–" : `${(1000 * s).toFixed(1)} ms`);
  const el = (tag, text, cls) => {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  };
  const fillBody = (table, rows) => {
    const body = $(table).tBodies[0];
    body.replaceChildren(...rows.map((cells) => {
      const tr = el("tr");
      cells.forEach((c) => tr.append(c instanceof Node ? c : el("td", c === null || c === undefined ? "–" : String(c))));
      return tr;
    }));
  };

  // --- problems (API errors, stream errors) -------------------------------------------------------------
  function problem(message, key) {
    const box = $("problems");
    const id = key ? `problem-${key}` : null;
    let item = id ? document.getElementById(id) : null;
    if (!item) {
      item = el("div", "", "problem");
      if (id) item.id = id;
      const close = el("button", "×", "close");
      close.type = "button";
      close.addEventListener("click", () => item.remove());
      item.append(el("span"), close);
      box.append(item);
    }
    item.firstChild.textContent = message;
  }
  const clearProblem = (key) => { const p = document.getElementById(`problem-${key}`); if (p) p.remove(); };

  // --- the token -----------------------------------------------------------------------------------------
  const token = () => sessionStorage.getItem(TOKEN_KEY);
  function showToken() {
    $("token-state").textContent = token() ? "token set: changes enabled" : "read-only";
    document.body.classList.toggle("can-write", Boolean(token()));
  }
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = $("token").value.trim();
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    $("token").value = "";
    showToken();
    reconnect();  // reads may need it too (admin_auth_reads)
  });
  $("token-forget").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); showToken(); });
  const authHeaders = () => (token() ? { Authorization: `Bearer ${token()}` } : {});

  // --- acting through the admin API ------------------------------------------------------------------------
  async function act(method, path, body) {
    if (!token()) {
      problem("This change needs the admin token: paste it above.", "token");
      return false;
    }
    clearProblem("token");
    const init = { method, headers: { ...authHeaders() } };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (err) {
      problem(`${method} ${path}: ${err}`, "action");
      return false;
    }
    if (response.ok) { clearProblem("action"); return true; }
    let message = `${response.status} ${response.statusText}`;
    try {
      const e = (await response.json()).error;
      message = `${e.status} ${e.code}: ${e.message}${e.detail ? ` ${JSON.stringify(e.detail)}` : ""}`;
    } catch (_) { /* not the API's error shape */ }
    problem(`${method} ${path} failed: ${message}`, "action");
    return false;
  }
  const endpointPath = (id) => `/v1/endpoints/${encodeURIComponent(id)}`;

  // --- endpoints table (rows kept, so a half-typed weight survives updates) ---------------------------------
  function endpointRow(id) {
    let row = state.rows.get(id);
    if (row) return row;
    const tr = el("tr");
    tr.dataset.endpoint = id;
    const cells = {};
    for (const name of ["id", "pool", "state", "weight", "computed", "pinned", "cpu", "queue", "inflight", "p50",
                        "p99", "tokens", "rps", "picks"]) {
      cells[name] = el("td");
      cells[name].dataset.col = name;
      tr.append(cells[name]);
    }
    const actions = el("td", undefined, "actions");
    const weight = el("input");
    Object.assign(weight, { type: "number", min: 1, max: 1000, placeholder: "1-1000" });
    weight.setAttribute("aria-label", `weight for ${id}`);
    const pin = el("button", "pin");
    const unpin = el("button", "unpin");
    const drain = el("button", "drain");
    for (const b of [pin, unpin, drain]) { b.type = "button"; b.classList.add("write"); }
    pin.addEventListener("click", async () => {
      const value = Number(weight.value);
      if (await act("PUT", `${endpointPath(id)}/weight`, { weight: value })) weight.value = "";
    });
    unpin.addEventListener("click", () => act("DELETE", `${endpointPath(id)}/weight`));
    drain.addEventListener("click", () => act(drain.dataset.draining === "true" ? "DELETE" : "POST",
                                              `${endpointPath(id)}/drain`));
    actions.append(weight, pin, unpin, drain);
    tr.append(actions);
    row = { tr, cells, drain };
    state.rows.set(id, row);
    return row;
  }

  function renderEndpoints(snap, picks) {
    const body = $("endpoints").tBodies[0];
    const seen = new Set();
    snap.endpoints.forEach((e) => {
      seen.add(e.id);
      const row = endpointRow(e.id);
      const t = e.telemetry || {};
      const c = row.cells;
      c.id.textContent = e.id;
      c.pool.textContent = e.pool || "–";
      c.state.textContent = e.state;
      c.state.className = `state ${e.state}`;
      c.weight.textContent = e.weight.effective;
      c.computed.textContent = e.weight.computed;
      c.pinned.textContent = e.weight.pinned === null ? "–" : e.weight.pinned;
      c.cpu.textContent = pct(t.cpu_utilization);
      c.queue.textContent = num(t.queue_depth);
      c.inflight.textContent = num(t.inflight);
      c.p50.textContent = ms(t.latency_p50_s);
      c.p99.textContent = ms(t.latency_p99_s);
      c.tokens.textContent = num(t.tokens_per_s, 0);
      c.rps.textContent = num(t.rps);
      c.picks.textContent = num(picks ? picks[e.id] : null);
      row.tr.classList.toggle("stale", Boolean(t.stale));
      row.drain.textContent = e.draining ? "undrain" : "drain";
      row.drain.dataset.draining = String(e.draining);
      body.append(row.tr);  // moves it into the snapshot's order
    });
    for (const [id, row] of state.rows) {
      if (!seen.has(id)) { row.tr.remove(); state.rows.delete(id); }
    }
    $("endpoint-count").textContent = `(${snap.endpoints.length})`;
  }

  // --- heat map: picks per endpoint (rows) over time (columns) ----------------------------------------------
  function renderHeatmap(snap) {
    const canvas = $("heatmap");
    const ids = snap.endpoints.map((e) => e.id);
    const points = state.points;
    const width = canvas.clientWidth || 600;
    const rowH = Math.max(6, Math.min(24, Math.floor(320 / Math.max(1, ids.length))));
    canvas.width = width;
    canvas.height = rowH * Math.max(1, ids.length);
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    let max = 0;
    let total = 0;
    for (const p of points) for (const id of ids) { const v = p.picks[id] || 0; max = Math.max(max, v); total += v; }
    const colW = width / Math.max(HEAT_MIN_COLUMNS, points.length);  // the newest column at the right edge
    const x0 = width - points.length * colW;
    points.forEach((p, i) => {
      ids.forEach((id, r) => {
        const v = p.picks[id] || 0;
        if (v <= 0 || max <= 0) return;
        const a = v / max;  // 0..1: light yellow to dark red
        ctx.fillStyle = `hsl(${50 - 50 * a}, 90%, ${88 - 48 * a}%)`;
        ctx.fillRect(x0 + i * colW, r * rowH, Math.ceil(colW), rowH - 1);
      });
    });
    canvas.dataset.total = total.toFixed(3);
    canvas.dataset.columns = String(points.length);
    $("heat-labels").replaceChildren(...ids.map((id) => {
      const label = el("div", id);
      label.dataset.endpoint = id;
      label.dataset.total = points.reduce((sum, p) => sum + (p.picks[id] || 0), 0).toFixed(3);
      label.style.height = `${rowH}px`;  // CSSOM, allowed by the CSP (style-src governs markup, not this)
      return label;
    }));
    const last = points[points.length - 1];
    $("heat-source").textContent = last ? (last.picks_source === "gateway" ? "(ext_proc's picks/s)"
                                                                          : "(workers' served req/s: no ext_proc read)")
      : "";
    $("heat-scale").textContent = `last ${points.length} s; darkest = ${num(max)}/s`;
  }

  // --- time series (uPlot) ---------------------------------------------------------------------------------
  const CHARTS = {
    "chart-rps": { series: [["served (workers)", "served_rps", "#2a6fdb"], ["requests (gateway)", "requests_per_s", "#999"]],
      unit: "/s" },
    "chart-latency": { series: [["p50 (gateway)", "p50_s", "#2a9d8f", 1000], ["p99 (gateway)", "p99_s", "#e76f51", 1000],
      ["slowest worker p99", "worker_p99_s", "#8338ec", 1000]], unit: "ms" },
    "chart-errors": { series: [["errors", "errors_per_s", "#d62828"], ["shed", "sheds_per_s", "#f77f00"],
      ["rate limited", "rate_limited_per_s", "#6c757d"]], unit: "/s" },
  };

  function chartData(spec) {
    const xs = state.points.map((p) => p.t);
    return [xs, ...spec.series.map(([, key, , scale]) => state.points.map((p) => (p[key] === null ? null
      : p[key] * (scale || 1))))];
  }

  function renderCharts() {
    if (typeof uPlot === "undefined") { problem("uPlot did not load: charts unavailable", "uplot"); return; }
    for (const [id, spec] of Object.entries(CHARTS)) {
      const data = chartData(spec);
      const chart = state.charts[id];
      if (chart) { chart.setData(data); continue; }
      const box = $(id);
      state.charts[id] = new uPlot({
        width: Math.max(300, box.clientWidth), height: 180, legend: { live: false },
        scales: { x: { time: true } },
        axes: [{}, { values: (u, ticks) => ticks.map((v) => `${v}${spec.unit === "ms" ? " ms" : ""}`) }],
        series: [{}, ...spec.series.map(([label, , stroke]) => ({ label, stroke, width: 1.5, points: { show: false } }))],
      }, data, box);
    }
  }
  window.addEventListener("resize", () => {
    for (const [id, chart] of Object.entries(state.charts)) chart.setSize({ width: Math.max(300, $(id).clientWidth), height: 180 });
    if (state.snapshot) renderHeatmap(state.snapshot);
  });

  // --- the other sections ------------------------------------------------------------------------------------
  function renderXds(snap) {
    const rows = [];
    for (const c of snap.xds_clients) {
      for (const [type, t] of Object.entries(c.types)) {
        const nack = t.last_nack ? `${t.last_nack.version}: ${t.last_nack.message}` : "";
        const sync = el("td", t.in_sync ? "yes" : "no", t.in_sync ? "ok" : "bad");
        const nacks = el("td", String(t.nacks), t.nacks ? "bad" : "");
        rows.push([c.node_id, c.group, c.mode, type, t.acked || "–", t.current || "–", sync, nacks, nack]);
      }
    }
    fillBody("xds", rows);
  }

  function renderModels(snap) {
    if (snap.models_error) problem(`models: ${snap.models_error}`, "models"); else clearProblem("models");
    const m = snap.models || { models: [], rollouts: [] };
    fillBody("models", m.models.map((v) => [v.id, v.aliases.join(", "), v.endpoints.map((e) => e.id).join(", "),
      v.routable ? "yes" : "no"]));
    const split = (s) => (s ? Object.entries(s.versions).map(([v, p]) => `${v} ${p}%`).join(", ") : "–");
    fillBody("rollouts", m.rollouts.map((r) => [r.alias, split(r), split(r.previous), r.unserved.join(", ") || "–"]));
  }

  function renderGateway(snap) {
    fillBody("tenants", snap.tenants.map((t) => [t.tenant, num(t.served), num(t.failed), num(t.rate_limited),
      num(t.shed), num(t.unauthenticated)]));
    fillBody("cache", snap.cache.map((c) => [c.level, num(c.hit), num(c.miss), num(c.bypass), pct(c.hit_ratio)]));
    const g = snap.gateway;
    const errors = Object.entries(g.errors).map(([n, e]) => `${n}: ${e}`).join("; ");
    $("gateway").textContent = g.replicas === 0
      ? "No ext_proc replica connected: gateway figures (picks, sheds, tenants, cache) unavailable."
      : `ext_proc replicas: ${g.read} of ${g.replicas} read${errors ? ` (${errors})` : ""}.`;
  }

  function renderPolicy(snap) {
    if (state.policyDirty) return;
    for (const [kind, select] of [["weight", $("weight-policy")], ["pick", $("pick-policy")]]) {
      const names = snap.policy.available[kind];
      if (select.dataset.names !== names.join(",")) {
        select.replaceChildren(...names.map((n) => { const o = el("option", n); o.value = n; return o; }));
        select.dataset.names = names.join(",");
      }
      select.value = snap.policy[kind].name;
    }
  }
  for (const id of ["weight-policy", "pick-policy"]) $(id).addEventListener("change", () => { state.policyDirty = true; });
  $("policy-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = {};
    const snap = state.snapshot;
    if (snap && $("weight-policy").value !== snap.policy.weight.name) body.weight = { name: $("weight-policy").value };
    if (snap && $("pick-policy").value !== snap.policy.pick.name) body.pick = { name: $("pick-policy").value };
    if (!Object.keys(body).length) { state.policyDirty = false; return; }
    if (await act("PUT", "/v1/policy", body)) state.policyDirty = false;
  });

  function render(snap) {
    state.snapshot = snap;
    const last = state.points[state.points.length - 1];
    renderEndpoints(snap, last ? last.picks : null);
    renderHeatmap(snap);
    renderCharts();
    renderXds(snap);
    renderModels(snap);
    renderGateway(snap);
    renderPolicy(snap);
    $("updated").textContent = `updated ${new Date(snap.at * 1000).toLocaleTimeString()} · ${snap.viewers} viewer(s)`;
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  }

  // --- the live feed: SSE read with fetch (EventSource cannot send the token) -----------------------------------
  let controller = null;
  function setConnection(text, ok) {
    $("conn").textContent = text;
    $("conn").className = `badge ${ok ? "on" : "off"}`;
  }

  function handle(event, data, first) {
    if (event === "snapshot") {
      const payload = JSON.parse(data);
      // A stream's first event carries the whole history: it replaces ours (the server may have restarted).
      state.points = (first ? payload.points : state.points.concat(payload.points)).slice(-MAX_POINTS);
      clearProblem("stream");
      render(payload);
    } else if (event === "problem") {
      problem(JSON.parse(data).message, "sample");
    }
  }

  async function connect() {
    controller = new AbortController();
    const mine = controller;
    try {
      const response = await fetch("/dashboard/events", { headers: { Accept: "text/event-stream", ...authHeaders() },
        signal: mine.signal, cache: "no-store" });
      if (!response.ok) {
        let message = `${response.status}`;
        try { message = (await response.json()).error.message; } catch (_) { /* keep the status */ }
        problem(`live feed refused: ${message}${response.status === 401 ? " (paste the admin token)" : ""}`, "stream");
        setConnection("refused", false);
      } else {
        setConnection("live", true);
        const reader = response.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "";
        let first = true;
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += decoder.decode(value, { stream: true });
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            const block = buffer.slice(0, cut);
            buffer = buffer.slice(cut + 2);
            let event = "message";
            const data = [];
            for (const line of block.split("\n")) {
              if (line.startsWith("event: ")) event = line.slice(7);
              else if (line.startsWith("data: ")) data.push(line.slice(6));
              else if (line.startsWith("retry: ")) state.retryMs = Number(line.slice(7)) || state.retryMs;
            }
            if (data.length) {
              handle(event, data.join("\n"), first && event === "snapshot");
              if (event === "snapshot") first = false;
            }
          }
        }
        setConnection("reconnecting", false);
      }
    } catch (err) {
      if (mine.signal.aborted) return;
      setConnection("reconnecting", false);
      problem(`live feed lost: ${err}; reconnecting`, "stream");
    }
    if (!mine.signal.aborted) setTimeout(() => { if (controller === mine) connect(); }, state.retryMs);
  }

  function reconnect() {
    if (controller) controller.abort();
    connect();
  }

  showToken();
  connect();
})();
