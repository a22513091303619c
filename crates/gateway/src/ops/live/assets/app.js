// slackgate live page: reads /live/stream (server-sent events, one frame a snapshot: the
// /stats document numbered `snapshot`), keeps the last minutes of frames and draws them.
// No framework: DOM built with textContent only (names from the config never become markup).
"use strict";

(function () {
  const KEEP_S = 300; // seconds of history drawn
  const state = { frames: [], lastSeq: 0, paused: false, charts: {}, lastAt: 0 };
  window.slackgateLive = state; // read by the browser test

  const $ = (id) => document.getElementById(id);
  const el = (tag, attrs, text) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };

  // Times in the reader's units: ms below a second, seconds below a minute, then minutes.
  function dur(ms) {
    if (ms === null || ms === undefined) return "none";
    if (ms < 1000) return `${Math.round(ms)} ms`;
    if (ms < 60000) return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
    const m = Math.floor(ms / 60000);
    return `${m} min ${Math.round((ms % 60000) / 1000)} s`;
  }
  const pct = (x) => `${(x * 100).toFixed(0)} %`;
  const classKey = (c) => (c.overflow ? `${c.name} (overflow)` : c.name);

  // A class whose slack is gone: a new request would wait past its deadline, or its
  // oldest job is past its queue-age threshold.
  function slackGone(c) {
    return (c.deadline_ms != null && c.projected_wait_ms >= c.deadline_ms) ||
      (c.max_queue_age_ms != null && c.oldest_queue_age_ms >= c.max_queue_age_ms) ||
      (c.deadline_ms != null && c.depth > 0 && c.oldest_queue_age_ms >= c.deadline_ms);
  }

  function cell(row, text, value, cls) {
    const td = el("td", {}, text);
    if (value !== undefined) td.dataset.value = String(value);
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }

  function renderFlags(f) {
    const g = f.gate;
    const flags = [
      ["admit_always", g.admit_always, "rollback: every request admitted"],
      ["shadow", g.shadow, "shadow: refusals logged, not enforced"],
      ["unlabeled_suspended", g.unlabeled_suspended, "unlabeled work refused (drain)"],
      ["closing", g.closing_at_ms != null, "shutting down"],
    ];
    const ul = $("flags");
    ul.replaceChildren();
    const needs = [];
    for (const [name, on, what] of flags) {
      const li = el("li", { "data-flag": name, "data-value": on ? "true" : "false", title: what },
        `${name}: ${on ? "ON" : "off"}`);
      if (on) { li.className = "on"; needs.push(`${name} is on (${what})`); }
      ul.appendChild(li);
    }
    return needs;
  }

  function renderClasses(f) {
    const body = $("class-table").tBodies[0];
    body.replaceChildren();
    const needs = [];
    for (const c of f.gate.classes) {
      const tr = el("tr", { "data-class": classKey(c) });
      const gone = slackGone(c);
      if (gone) { tr.className = "alert"; needs.push(`${classKey(c)}: slack is gone`); }
      const st = [];
      if (gone) st.push("SLACK GONE");
      if (!c.enabled) st.push("disabled");
      if (c.draining) st.push("draining");
      if (c.retired) st.push("retired");
      cell(tr, classKey(c));
      cell(tr, st.join(", ") || "ok", undefined, "state");
      cell(tr, c.pool);
      cell(tr, String(c.depth), c.depth, "num").dataset.field = "depth";
      cell(tr, dur(c.oldest_queue_age_ms), c.oldest_queue_age_ms, "num").dataset.field = "oldest_queue_age_ms";
      cell(tr, dur(c.projected_wait_ms), c.projected_wait_ms, "num").dataset.field = "projected_wait_ms";
      cell(tr, dur(c.deadline_ms), c.deadline_ms ?? "", "num").dataset.field = "deadline_ms";
      cell(tr, dur(c.max_queue_age_ms), c.max_queue_age_ms ?? "", "num").dataset.field = "max_queue_age_ms";
      cell(tr, String(c.in_flight), c.in_flight, "num").dataset.field = "in_flight";
      const e = c.est_error;
      cell(tr, e.samples ? `${pct(e.median)} (${e.samples})` : "no data", e.median, "num");
      if (!c.enabled || c.draining) needs.push(`${classKey(c)} is ${c.draining ? "draining" : "disabled"}`);
      body.appendChild(tr);
    }
    return needs;
  }

  function renderEndpoints(f) {
    const body = $("endpoint-table").tBodies[0];
    body.replaceChildren();
    const needs = [];
    for (const p of f.gate.pools) {
      for (const e of p.endpoints) {
        const tr = el("tr", { "data-endpoint": `${p.name}/${e.name}` });
        const st = [];
        if (e.ejected) st.push("EJECTED");
        if (e.draining) st.push("draining");
        if (e.paused_ms > 0) st.push(`paused ${dur(e.paused_ms)}`);
        if (e.limit < e.slots) st.push(`limited to ${e.limit}`);
        if (e.retired) st.push("retired");
        if (e.ejected || e.draining || e.paused_ms > 0) {
          tr.className = "alert";
          needs.push(`${p.name}/${e.name}: ${st.join(", ")}`);
        }
        cell(tr, p.name);
        cell(tr, e.name);
        cell(tr, st.join(", ") || "ok", undefined, "state");
        cell(tr, `${e.in_flight} / ${e.limit}`, e.in_flight, "num").dataset.field = "in_flight";
        cell(tr, dur(p.oldest_in_flight_age_ms), p.oldest_in_flight_age_ms, "num");
        cell(tr, String(p.depth), p.depth, "num");
        body.appendChild(tr);
      }
    }
    return needs;
  }

  // The tenants with the most work queued per class (the gate keeps the list short), each
  // held to its share: a tenant refused on its share is flooding, and highlighted.
  function renderTenants(f) {
    const body = $("tenant-table").tBodies[0];
    body.replaceChildren();
    const needs = [];
    let any = false;
    for (const c of f.gate.classes) {
      for (const t of c.tenants || []) {
        any = true;
        const tr = el("tr", { "data-tenant": `${classKey(c)}|${t.tenant}` });
        // Refused on its share since the last frame: flooding now (not an old refusal).
        const prev = state.frames.length > 1 ? state.frames[state.frames.length - 2] : null;
        const pc = prev && prev.gate.classes.find((y) => classKey(y) === classKey(c));
        const pt = pc && (pc.tenants || []).find((x) => x.tenant === t.tenant);
        if (t.refused_share > (pt ? pt.refused_share : 0)) {
          tr.className = "alert";
          needs.push(`${classKey(c)}: tenant ${t.tenant} refused on its share (${t.refused_share})`);
        }
        cell(tr, classKey(c));
        cell(tr, t.tenant);
        cell(tr, String(t.weight), t.weight, "num");
        cell(tr, pct(t.share), t.share, "num").dataset.field = "share";
        cell(tr, String(t.queued), t.queued, "num").dataset.field = "queued";
        cell(tr, dur(t.queued_work_ms), t.queued_work_ms, "num").dataset.field = "queued_work_ms";
        cell(tr, String(t.admitted), t.admitted, "num").dataset.field = "admitted";
        cell(tr, String(t.refused_share), t.refused_share, "num").dataset.field = "refused_share";
        body.appendChild(tr);
      }
    }
    $("tenants-off").hidden = any;
    return needs;
  }

  function renderDecisions(f) {
    const body = $("decision-table").tBodies[0];
    body.replaceChildren();
    for (const d of f.decisions) {
      const tr = el("tr", { "data-key": `${d.class}|${d.action}|${d.reason}` });
      cell(tr, d.class); cell(tr, d.action); cell(tr, d.reason);
      cell(tr, String(d.count), d.count, "num").dataset.field = "count";
      body.appendChild(tr);
    }
  }

  function renderRole(f) {
    const p = $("role");
    const c = f.cluster;
    if (!c || c.role === "leader") { p.hidden = true; return []; }
    p.hidden = false;
    const leader = c.leader ? `${c.leader.id} at ${c.leader.url}` : "no leader in reach";
    p.textContent = c.role === "follower"
      ? `This replica is a FOLLOWER: it forwards to the leader (${leader}), which decides. ` +
        "Queues and decisions below are this replica's; open the leader's admin /live for the gate's view."
      : `This replica is DEGRADED: ${leader}; requests follow their class's fail mode.`;
    return c.role === "degraded" ? ["replica degraded: no leader in reach"] : [];
  }

  // --- charts ------------------------------------------------------------------------
  const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#116329", "#a40e26",
    "#0550ae", "#6e7781", "#953800"];

  function chartWidth(box) { return Math.max(280, Math.min(box.clientWidth || 600, 1400)); }

  // One uPlot chart per key, rebuilt when its series change (a class or reason appears).
  function draw(key, box, title, names, data, yLabel, fmt, whole) {
    const sig = names.join("\u0001");
    let ch = state.charts[key];
    if (ch && ch.sig !== sig) { ch.plot.destroy(); ch.wrap.remove(); ch = null; }
    if (!ch) {
      // Charts without a title of their own are named by their section's heading.
      const section = box.closest("section");
      const label = title || (section ? section.querySelector("h2").textContent : key);
      const wrap = el("div", { class: "chart", role: "img", "aria-label": `chart: ${label}` });
      if (title) wrap.appendChild(el("h3", {}, title));
      box.appendChild(wrap);
      const series = [{ label: "time" }].concat(names.map((n, i) => ({
        label: n, stroke: COLORS[i % COLORS.length], width: n.startsWith("deadline") ||
          n.startsWith("slots") ? 2 : 1.5, dash: n.startsWith("deadline") || n.startsWith("slots") ? [6, 4] : undefined,
        value: (u, v) => (v == null ? "-" : fmt(v)),
      })));
      const opts = {
        width: chartWidth(wrap), height: 190, series,
        scales: { x: { time: true } },
        axes: [{}, Object.assign({ label: yLabel, size: 60, values: (u, vals) => vals.map(fmt) },
          whole ? { incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] } : {})],
        legend: { live: true },
      };
      ch = { sig, wrap, plot: new uPlot(opts, data, wrap) };
      state.charts[key] = ch;
    } else {
      ch.plot.setData(data);
    }
    return ch;
  }

  const secs = (ms) => (ms == null ? null : ms / 1000);
  const fmtS = (v) => (v == null ? "-" : v >= 60 ? `${(v / 60).toFixed(1)} min` : v >= 1 ? `${v.toFixed(1)} s` : `${Math.round(v * 1000)} ms`);

  function drawAll() {
    const fr = state.frames;
    if (fr.length === 0) return;
    const xs = fr.map((f) => f.unix_ms / 1000);
    const last = fr[fr.length - 1];
    // Queue age and projected wait against the deadline, per class.
    const box = $("class-charts");
    const seen = new Set();
    for (const c of last.gate.classes) {
      const k = classKey(c);
      seen.add(`class:${k}`);
      const pick = (fld) => fr.map((f) => {
        const x = f.gate.classes.find((y) => classKey(y) === k);
        return x ? secs(x[fld]) : null;
      });
      const names = ["oldest queue age", "projected wait"];
      const data = [xs, pick("oldest_queue_age_ms"), pick("projected_wait_ms")];
      if (c.deadline_ms != null) { names.push("deadline (slack budget)"); data.push(pick("deadline_ms")); }
      if (c.max_queue_age_ms != null) { names.push("max queue age"); data.push(pick("max_queue_age_ms")); }
      const ch = draw(`class:${k}`, box, k, names, data, "wait", fmtS);
      ch.wrap.classList.toggle("alert", slackGone(c));
    }
    for (const key of Object.keys(state.charts)) {
      if (key.startsWith("class:") && !seen.has(key)) {
        state.charts[key].plot.destroy(); state.charts[key].wrap.remove(); delete state.charts[key];
      }
    }
    // Decisions per second by action and reason (all classes), from the totals' differences.
    // Admission decisions only (admit, refuse, drop): dispatches and completions are in the table.
    const DECIDED = new Set(["admit", "reject", "shadow_reject", "drop", "error"]);
    const decided = (f) => f.decisions.filter((d) => DECIDED.has(d.action));
    const reasons = [...new Set(fr.flatMap((f) => decided(f).map((d) => `${d.action}: ${d.reason}`)))].sort();
    const sums = fr.map((f) => {
      const m = new Map();
      for (const d of decided(f)) { const k = `${d.action}: ${d.reason}`; m.set(k, (m.get(k) || 0) + d.count); }
      return m;
    });
    const rate = reasons.map((r) => sums.map((m, i) => {
      if (i === 0) return null;
      const dt = (fr[i].unix_ms - fr[i - 1].unix_ms) / 1000;
      return dt > 0 ? Math.max(0, ((m.get(r) || 0) - (sums[i - 1].get(r) || 0)) / dt) : null;
    }));
    draw("decisions", $("decision-chart"), "", reasons, [xs, ...rate], "per second", (v) => (v == null ? "-" : v.toFixed(1)));
    // Each shown tenant's share over time, per class.
    const tKeys = [...new Set(fr.flatMap((f) => f.gate.classes.flatMap((c) => (c.tenants || []).map((t) => `${classKey(c)}|${t.tenant}`))))].sort();
    if (tKeys.length > 0) {
      const tData = tKeys.map((key) => fr.map((f) => {
        const cut = key.indexOf("|");
        const ck = key.slice(0, cut), tn = key.slice(cut + 1);
        const c = f.gate.classes.find((y) => classKey(y) === ck);
        const t = c && (c.tenants || []).find((x) => x.tenant === tn);
        return t ? t.share * 100 : null;
      }));
      draw("tenants", $("tenant-chart"), "", tKeys.map((k) => k.replace("|", ": ")), [xs, ...tData], "share %", (v) => (v == null ? "-" : `${v.toFixed(0)} %`));
    }
    // In flight per endpoint, with the slots in force.
    const eps = last.gate.pools.flatMap((p) => p.endpoints.map((e) => [p.name, e.name]));
    const epNames = [], epData = [];
    for (const [p, e] of eps) {
      const get = (fld) => fr.map((f) => {
        const pool = f.gate.pools.find((x) => x.name === p);
        const ep = pool && pool.endpoints.find((x) => x.name === e);
        return ep ? ep[fld] : null;
      });
      epNames.push(`${p}/${e} in flight`); epData.push(get("in_flight"));
      epNames.push(`slots ${p}/${e}`); epData.push(get("limit"));
    }
    draw("endpoints", $("endpoint-chart"), "", epNames, [xs, ...epData], "requests", (v) => (v == null ? "-" : String(Math.round(v))), true);
    // Estimator error: median |predicted - actual| / actual, and bias, per class.
    const estNames = [], estData = [];
    for (const c of last.gate.classes) {
      const k = classKey(c);
      const get = (fld) => fr.map((f) => {
        const x = f.gate.classes.find((y) => classKey(y) === k);
        return x && x.est_error.samples > 0 ? x.est_error[fld] * 100 : null;
      });
      estNames.push(`${k} median error`); estData.push(get("median"));
      estNames.push(`${k} bias`); estData.push(get("bias"));
    }
    draw("estimator", $("estimator-chart"), "", estNames, [xs, ...estData], "% of actual", (v) => (v == null ? "-" : `${v.toFixed(0)} %`));
  }

  function render() {
    const f = state.frames[state.frames.length - 1];
    if (!f) return;
    const needs = [].concat(renderRole(f), renderFlags(f), renderClasses(f), renderTenants(f), renderEndpoints(f));
    renderDecisions(f);
    const ul = $("needs");
    ul.replaceChildren(...(needs.length ? needs.map((n) => el("li", {}, n)) : [el("li", { class: "ok" }, "nothing")]));
    const st = $("status");
    st.dataset.snapshot = String(f.snapshot);
    st.textContent = `snapshot ${f.snapshot} at ${new Date(f.unix_ms).toLocaleTimeString()}` +
      (state.paused ? " (paused)" : "");
    st.classList.remove("stale");
    drawAll();
    state.shown = f.snapshot;
  }

  function onFrame(ev) {
    let f;
    try { f = JSON.parse(ev.data); } catch (e) { return; }
    if (typeof f.snapshot !== "number" || f.snapshot <= state.lastSeq) return;
    state.lastSeq = f.snapshot;
    state.lastAt = Date.now();
    state.frames.push(f);
    const cut = f.unix_ms - KEEP_S * 1000;
    while (state.frames.length && state.frames[0].unix_ms < cut) state.frames.shift();
    if (!state.paused) render();
  }

  // A page that gets no frame says so: the browser retries a dropped stream on its own, but
  // a refused one (401: the session expired) is closed for good.
  function stale(es) {
    const st = $("status");
    if (es.readyState === EventSource.CLOSED) {
      st.classList.add("stale");
      st.textContent = "stream closed (session expired?): open /live?token=<admin token> again";
    } else if (state.lastAt && Date.now() - state.lastAt > 5000) {
      st.classList.add("stale");
      st.textContent = `no frame for ${dur(Date.now() - state.lastAt)}: reconnecting`;
    }
  }

  function connect() {
    const es = new EventSource("/live/stream");
    es.addEventListener("frame", onFrame);
    es.onerror = () => stale(es);
    setInterval(() => stale(es), 2000);
  }

  function togglePause() {
    state.paused = !state.paused;
    $("pause").setAttribute("aria-pressed", String(state.paused));
    $("pause").textContent = state.paused ? "Resume" : "Pause";
    render();
  }
  $("pause").addEventListener("click", togglePause);
  document.addEventListener("keydown", (e) => {
    if (e.key === "p" && !e.ctrlKey && !e.metaKey && !e.altKey && e.target === document.body) togglePause();
  });
  let resizeTimer = 0;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      for (const ch of Object.values(state.charts)) ch.plot.setSize({ width: chartWidth(ch.wrap), height: 190 });
    }, 150);
  });
  connect();
})();
