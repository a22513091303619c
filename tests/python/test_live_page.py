"""The live page (/live on the admin listener) in a real browser: Debian's chromium driven by
Playwright, against a real gate and stub under a burst of load.

The page must show what the gate knows, and nothing else: under load each frame the page
draws names its snapshot, and the figures in the page (class queue age, projected wait,
depth, in flight; endpoint slots; decision totals) equal `/stats?snapshot=N` for that
snapshot; once the load has stopped, the page's totals by class, action and reason equal
the live `/stats`. The charts must have drawn several frames. A screenshot is saved (in the
test's tmp_path, and in $SLACKGATE_LIVE_SCREENSHOTS when set).

Needs `playwright` (tests/python/requirements.txt) and a chromium (/usr/bin/chromium, or
$SLACKGATE_CHROMIUM); scripts/test.sh installs both. Missing either fails the test.
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import ProcessGroup, free_port, wait_healthy


def wait_listening(proc, out: Path, port: int, what: str, timeout_s: float = 20.0) -> None:
    """Wait until something accepts TCP connections on 127.0.0.1:`port`, failing at once if
    `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}:\n"
                               + out.read_text(errors="replace"))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s} s")

TOKEN = "live-page-test-token-7f3a9c"
FRAME_MS = 500

CONFIG = """
default_class = "interactive"
[server]
listen = "$listen"
tick_ms = 10
fairness_header = "x-team"
[fairness]
unlisted = "own"
[log]
path = "$log"
[admin]
listen = "127.0.0.1:ADMIN_PORT"
token_file = "TOKEN_FILE"
live_frame_ms = FRAME_MS
[[pools]]
name = "default"
slots = 2
upstream = "$upstream"
[pools.prior]
overhead_ms = 5
prefill_ms_per_token = 0
decode_ms_per_token = 10
learn = true
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 1500
[[classes]]
name = "batch"
priority = 10
max_queue_age_ms = 800
"""


def chromium_path() -> str:
    path = os.environ.get("SLACKGATE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"no chromium at {path}: scripts/test.sh installs Debian's chromium package "
                    "(apt-get install -y chromium), or set SLACKGATE_CHROMIUM", pytrace=False)
    return path


def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright as sp
    except ImportError:
        pytest.fail("the playwright package is missing: scripts/venv.sh installs "
                    "tests/python/requirements.txt into .venv", pytrace=False)
    return sp


# Everything the checks compare, read from the page's DOM in one go (the page cannot change
# between two reads of one evaluate: its script runs on the same thread).
READ_PAGE = """() => {
  const st = document.getElementById('status');
  const val = (td) => td ? td.dataset.value : undefined;
  const classes = {};
  for (const tr of document.querySelectorAll('#class-table tbody tr')) {
    const row = {};
    for (const td of tr.querySelectorAll('td[data-field]')) row[td.dataset.field] = td.dataset.value;
    classes[tr.dataset.class] = row;
  }
  const endpoints = {};
  for (const tr of document.querySelectorAll('#endpoint-table tbody tr')) {
    endpoints[tr.dataset.endpoint] = val(tr.querySelector('td[data-field=in_flight]'));
  }
  const decisions = {};
  for (const tr of document.querySelectorAll('#decision-table tbody tr')) {
    decisions[tr.dataset.key] = val(tr.querySelector('td[data-field=count]'));
  }
  const tenants = {};
  for (const tr of document.querySelectorAll('#tenant-table tbody tr')) {
    const row = {};
    for (const td of tr.querySelectorAll('td[data-field]')) row[td.dataset.field] = td.dataset.value;
    tenants[tr.dataset.tenant] = row;
  }
  const flags = {};
  for (const li of document.querySelectorAll('#flags li')) flags[li.dataset.flag] = li.dataset.value;
  const charts = {};
  for (const [k, ch] of Object.entries(window.slackgateLive.charts)) charts[k] = ch.plot.data[0].length;
  return {snapshot: Number(st.dataset.snapshot), classes, endpoints, decisions, tenants, flags, charts};
}"""


def expected(doc: dict) -> dict:
    """What the page must show for a /stats document."""
    classes = {}
    for c in doc["gate"]["classes"]:
        key = f"{c['name']} (overflow)" if c["overflow"] else c["name"]
        classes[key] = {
            "depth": str(c["depth"]),
            "oldest_queue_age_ms": str(c["oldest_queue_age_ms"]),
            "projected_wait_ms": str(c["projected_wait_ms"]),
            "deadline_ms": "" if c["deadline_ms"] is None else str(c["deadline_ms"]),
            "max_queue_age_ms": "" if c["max_queue_age_ms"] is None else str(c["max_queue_age_ms"]),
            "in_flight": str(c["in_flight"]),
        }
    endpoints = {f"{p['name']}/{e['name']}": str(e["in_flight"])
                 for p in doc["gate"]["pools"] for e in p["endpoints"]}
    decisions = {f"{d['class']}|{d['action']}|{d['reason']}": str(d["count"])
                 for d in doc["decisions"]}
    flags = {"admit_always": str(doc["gate"]["admit_always"]).lower(),
             "shadow": str(doc["gate"]["shadow"]).lower()}
    tenants = {}
    for c in doc["gate"]["classes"]:
        key = f"{c['name']} (overflow)" if c["overflow"] else c["name"]
        for t in c["tenants"]:
            tenants[f"{key}|{t['tenant']}"] = {
                "share": js_number(t["share"]),
                "queued": str(t["queued"]),
                "queued_work_ms": str(t["queued_work_ms"]),
                "admitted": str(t["admitted"]),
                "refused_share": str(t["refused_share"]),
            }
    return {"classes": classes, "endpoints": endpoints, "decisions": decisions,
            "tenants": tenants, "flags": flags}


def js_number(x: float) -> str:
    """A number as JavaScript's String() writes it (1 for 1.0; shortest round trip else)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def check_against_stats(shown: dict, doc: dict) -> None:
    want = expected(doc)
    assert shown["classes"] == want["classes"], (shown["snapshot"], shown["classes"], want["classes"])
    assert shown["endpoints"] == want["endpoints"]
    assert shown["decisions"] == want["decisions"]
    assert shown["tenants"] == want["tenants"], (shown["snapshot"], shown["tenants"], want["tenants"])
    for k, v in want["flags"].items():
        assert shown["flags"][k] == v, k


def load(gate_url: str, stop: threading.Event, counts: dict) -> None:
    """A burst: 12 clients at once, interactive and batch, until `stop` (bounded by the
    caller). Some are admitted, some refused."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 30}

    def client(i: int) -> None:
        cls = "interactive" if i % 3 else "batch"
        with httpx.Client(timeout=10.0) as c:
            while not stop.is_set():
                r = c.post(f"{gate_url}/v1/chat/completions", json=body,
                           headers={"x-job-class": cls, "x-team": f"team-{i % 3}"})
                counts[r.status_code] = counts.get(r.status_code, 0) + 1
                if r.status_code != 200:
                    time.sleep(0.05)

    with ThreadPoolExecutor(12) as pool:
        for i in range(12):
            pool.submit(client, i)


def test_live_page_in_chromium_equals_stats(gate_stack, tmp_path: Path):
    chromium = chromium_path()
    sp = sync_playwright()
    admin_port = free_port()
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    config = (CONFIG.replace("ADMIN_PORT", str(admin_port))
              .replace("TOKEN_FILE", str(token_file)).replace("FRAME_MS", str(FRAME_MS)))
    stack = gate_stack(config, stub_slots=2, stub_latency="tokens:prefill_us=0,decode_us=10000")
    admin = f"http://127.0.0.1:{admin_port}"
    stop = threading.Event()
    counts: dict = {}
    loader = threading.Thread(target=load, args=(stack.gate_url, stop, counts), daemon=True)
    errors: list[str] = []
    shot = tmp_path / "live-page.png"
    with sp() as p:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=args)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            loader.start()
            page.goto(f"{admin}/live?token={TOKEN}")
            # The redirect dropped the token from the URL; the cookie is HttpOnly and strict.
            assert page.url == f"{admin}/live", page.url
            (cookie,) = [c for c in page.context.cookies() if c["name"] == "slackgate_live"]
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
            assert cookie["path"] == "/live"
            page.wait_for_function("() => window.slackgateLive && window.slackgateLive.shown >= 3",
                                   timeout=20000)
            # Under load: frame after frame, what the page shows is /stats at its snapshot.
            checked, busy = 0, 0
            deadline = time.monotonic() + 20
            last = 0
            while (checked < 4 or busy < 2) and time.monotonic() < deadline:
                shown = page.evaluate(READ_PAGE)
                if shown["snapshot"] > last:
                    last = shown["snapshot"]
                    r = httpx.get(f"{stack.gate_url}/stats?snapshot={last}", timeout=5)
                    assert r.status_code == 200, r.text
                    doc = r.json()
                    assert doc["snapshot"] == last
                    check_against_stats(shown, doc)
                    checked += 1
                    if any(c["depth"] > 0 or c["in_flight"] > 0 for c in doc["gate"]["classes"]):
                        busy += 1
                time.sleep(FRAME_MS / 1000 / 2)
            assert checked >= 4 and busy >= 2, (checked, busy)
            # The charts drew the frames (uPlot's data: one x per frame kept).
            shown = page.evaluate(READ_PAGE)
            # Three teams, each with its share shown (fairness: every team its own bucket).
            assert {k.split("|")[1] for k in shown["tenants"]} == {"team-0", "team-1", "team-2"}, shown["tenants"]
            for key in ("class:interactive", "class:batch", "decisions", "endpoints", "estimator", "tenants"):
                assert shown["charts"].get(key, 0) >= 3, (key, shown["charts"])
            page.screenshot(path=str(shot), full_page=True)
            stop.set()
            loader.join(timeout=15)
            assert not loader.is_alive()
            assert counts.get(200, 0) > 0 and counts.get(429, 0) > 0, counts
            # After the load: once the gate is quiet, the page's totals equal /stats.
            settled = None
            until = time.monotonic() + 15
            while time.monotonic() < until:
                a = stack.gate_stats()
                time.sleep(FRAME_MS / 1000 * 2)
                b = stack.gate_stats()
                pool = b["gate"]["pools"][0]
                if a["decisions"] == b["decisions"] and pool["in_flight"] == 0 and pool["depth"] == 0:
                    settled = b
                    break
            assert settled is not None, "the gate never went quiet"
            after = page.evaluate(READ_PAGE)["snapshot"]
            page.wait_for_function(f"() => window.slackgateLive.shown > {after}", timeout=10000)
            shown = page.evaluate(READ_PAGE)
            assert shown["decisions"] == expected(stack.gate_stats())["decisions"]
            assert shown["decisions"] == expected(settled)["decisions"]
            refused = [k for k in shown["decisions"] if "|reject|" in k]
            assert refused, shown["decisions"]
            # The page loaded its assets under its policy: no errors in the console.
            assert not errors, errors
        finally:
            browser.close()
            stop.set()
    assert shot.stat().st_size > 10_000
    out = os.environ.get("SLACKGATE_LIVE_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(out) / "live-page-test.png")


def test_a_follower_says_so_and_names_its_leader(binary, tmp_path: Path):
    """Cluster mode: two replicas on their own redis-server; the follower's page says plainly
    that it is a follower, and names the leader, above everything else."""
    chromium = chromium_path()
    sp = sync_playwright()
    redis_server = os.environ.get("SLACKGATE_REDIS_SERVER") or shutil.which("redis-server")
    if not redis_server:
        pytest.fail("redis-server is missing: scripts/test.sh installs Debian's redis-server",
                    pytrace=False)
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN)
    procs = ProcessGroup(tmp_path)
    try:
        stub_port, redis_port = free_port(), free_port()
        stub, out = procs.start("stub", [str(binary), "stub", "--listen", f"127.0.0.1:{stub_port}"])
        wait_healthy(stub, out, f"http://127.0.0.1:{stub_port}/health", "stub")
        redis, redis_out = procs.start("redis", [redis_server, "--port", str(redis_port),
                                                 "--bind", "127.0.0.1", "--save", "",
                                                 "--appendonly", "no"])
        # A replica that cannot reach Redis at start exits (it needs the cluster's tenant
        # hash key): wait until redis-server takes connections.
        wait_listening(redis, redis_out, redis_port, "redis-server")
        gates = {}
        for role in ("first", "second"):
            port, admin = free_port(), free_port()
            cfg = tmp_path / f"{role}.toml"
            cfg.write_text(f"""
[server]
listen = "127.0.0.1:{port}"
[log]
path = "off"
[admin]
listen = "127.0.0.1:{admin}"
token_file = "{token_file}"
live_frame_ms = 200
[cluster]
redis = "redis://127.0.0.1:{redis_port}"
name = "live-test"
replica_id = "{role}"
advertise = "http://127.0.0.1:{port}"
lease_ttl_ms = 1000
redis_timeout_ms = 250
[[pools]]
name = "default"
slots = 2
upstream = "http://127.0.0.1:{stub_port}"
[[classes]]
name = "interactive"
deadline_ms = 5000
""")
            gate, gout = procs.start(role, [str(binary), "serve", "--config", str(cfg)])
            wait_healthy(gate, gout, f"http://127.0.0.1:{port}/healthz", role)
            gates[role] = (port, admin)
            if role == "first":
                # The first takes the lease before the second starts.
                until = time.monotonic() + 15
                while time.monotonic() < until:
                    s = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=2).json()
                    if s["cluster"] and s["cluster"]["role"] == "leader":
                        break
                    time.sleep(0.1)
                else:
                    pytest.fail("the first replica never led")
        port, admin = gates["second"]
        until = time.monotonic() + 15
        while time.monotonic() < until:
            s = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=2).json()
            if s["cluster"]["role"] == "follower":
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"the second replica never followed: {s['cluster']}")
        with sp() as p:
            args = ["--no-sandbox"] if os.geteuid() == 0 else []
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=args)
            try:
                page = browser.new_page(viewport={"width": 1000, "height": 700})
                page.goto(f"http://127.0.0.1:{admin}/live?token={TOKEN}")
                page.wait_for_function("() => window.slackgateLive && window.slackgateLive.shown >= 1",
                                       timeout=15000)
                banner = page.locator("#role")
                assert banner.is_visible()
                text = banner.inner_text()
                assert "FOLLOWER" in text and "first" in text, text
                # The leader's own page has no such banner.
                page.goto(f"http://127.0.0.1:{gates['first'][1]}/live?token={TOKEN}")
                page.wait_for_function("() => window.slackgateLive && window.slackgateLive.shown >= 1",
                                       timeout=15000)
                assert not page.locator("#role").is_visible()
            finally:
                browser.close()
    finally:
        procs.stop_all()
