"""The drill report as one HTML file, in a real browser: `slackgate drill` of the three-tenant
flood (scenarios/tenants-flood.toml, gate on, at a twentieth of real time) writes
report.html; Debian's chromium opens it from disk with no network and must draw every chart
(queue age, refusals, refusals by reason, on time by class and by tenant, queued and in
flight) with no error in its console, and the by-reason chart must name the flooding
tenant's `tenant_share_exceeded`.

Needs `playwright` and a chromium, as test_live_page.py; scripts/test.sh installs both.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from test_live_page import chromium_path, sync_playwright

REPO = Path(__file__).resolve().parents[2]

READ = """() => {
  const charts = {};
  for (const box of document.querySelectorAll('.chart')) {
    if (box.closest('[hidden]')) continue;
    charts[box.id] = [...box.querySelectorAll('.u-legend .u-series .u-label')].map((l) => l.textContent);
  }
  return charts;
}"""


def test_the_drill_report_draws_every_chart_in_chromium(binary: Path, tmp_path: Path):
    out = tmp_path / "drill"
    run = subprocess.run(
        [str(binary), "drill", str(REPO / "scenarios/tenants-flood.toml"),
         "--time-scale", "0.05", "--run", "on", "--out", str(out)],
        capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    html = out / "report.html"
    assert html.stat().st_size > 50_000, "uPlot and the data are inlined"
    chromium = chromium_path()
    errors: list[str] = []
    requests: list[str] = []
    with sync_playwright()() as p:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=args)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1600})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(html.as_uri())
            page.wait_for_selector(".uplot")
            charts = page.evaluate(READ)
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    assert [u for u in requests if not u.startswith("file:")] == [], "one file, no network"
    for chart in ("queue_age", "rejections", "by_reason", "on_time_by_class",
                  "on_time_by_tenant", "depth"):
        assert charts.get(chart), (chart, charts)
    assert any("tenant_share_exceeded" in s for s in charts["by_reason"]), charts["by_reason"]
    assert {s.split(": ", 1)[1] for s in charts["on_time_by_tenant"] if ": " in s} >= {
        "A (interactive)", "B (interactive)", "C (interactive)"}, charts["on_time_by_tenant"]
