// The drill's report.html: draws the charts from the embedded JSON with uPlot (the live
// page's colours and units). Inlined by crates/drill/src/html.rs.
"use strict";
(function () {
  const d = JSON.parse(document.getElementById("data").textContent);
  const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#6e7781"];
  const width = () => Math.max(300, Math.min(document.body.clientWidth - 40, 1150));
  function chart(id, yLabel, series, fmt) {
    const n = Math.max(0, ...series.map((s) => s.values.length));
    const period = d.runs.length ? d.runs[0].period_ms : 1000;
    const xs = Array.from({ length: n }, (_, i) => (i * period) / 1000);
    const data = [xs, ...series.map((s) => xs.map((_, i) => (i < s.values.length ? s.values[i] : null)))];
    const opts = {
      width: width(), height: 240,
      scales: { x: { time: false } },
      series: [{ label: "time (s)" }, ...series.map((s, i) => ({
        label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5, dash: s.dash,
        value: (u, v) => (v == null ? "-" : fmt(v)) }))],
      axes: [{ label: "scenario time (s)" }, { label: yLabel, size: 60, values: (u, vals) => vals.map(fmt) }],
    };
    new uPlot(opts, data, document.getElementById(id));
  }
  const secs = (v) => (v >= 60 ? `${(v / 60).toFixed(1)} min` : v >= 1 ? `${v.toFixed(1)} s` : `${Math.round(v * 1000)} ms`);
  chart("queue_age", "queue age", d.runs.map((r) => ({ label: r.policy, values: r.queue_age_ms.map((v) => v / 1000) })), secs);
  chart("rejections", "per period", d.runs.map((r) => ({ label: r.policy, values: r.rejections })), (v) => String(Math.round(v)));
  // In flight only where the run recorded it (a drill's live runs may not).
  chart("depth", "jobs", d.runs.flatMap((r) => [{ label: `${r.policy} queued`, values: r.depth }].concat(
    r.in_flight.some((v) => v > 0) ? [{ label: `${r.policy} in flight`, values: r.in_flight, dash: [6, 4] }] : [])),
    (v) => String(Math.round(v)));
  // Per run and reason, class or tenant: the live page's decisions by reason, and on-time
  // completions, over the run.
  const named = (key) => d.runs.flatMap((r) => r[key].map((s) => ({ label: `${r.policy}: ${s.label}`, values: s.values })));
  const count = (v) => String(Math.round(v));
  chart("by_reason", "per period", named("by_reason"), count);
  chart("on_time_by_class", "per period", named("on_time_by_class"), count);
  const tenants = named("on_time_by_tenant");
  if (tenants.length) chart("on_time_by_tenant", "per period", tenants, count);
  else document.getElementById("tenants").hidden = true;
  const body = document.querySelector("#work tbody");
  for (const w of d.work) {
    const tr = document.createElement("tr");
    for (const [text, num] of [[w.policy, false], [w.on_time_work_s.toFixed(1), true], [w.wasted_work_s.toFixed(1), true]]) {
      const td = document.createElement("td");
      td.textContent = text;
      if (num) td.className = "num";
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
})();
