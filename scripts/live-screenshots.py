#!/usr/bin/env python3
"""Screenshots of the live page (/live) during two seed drills, for docs/live.md.

    .venv/bin/python scripts/live-screenshots.py [OUT_DIR]   (default: docs/img)

For each of seed 003's probe burst and seed 000's burst it starts a `slackgate stub` shaped
like the scenario's [upstream] and a `slackgate serve` with the scenario's classes and priors
(durations scaled to the drill's time scale, as the drill's own gate scales them, written out
below), with its admin listener; runs `slackgate drill SCENARIO --gate ... --upstream ...
--run on` against it (load on 127.0.0.1 only, bounded by the scenario); opens the page in
headless chromium (Playwright, /usr/bin/chromium) and takes a screenshot at the given moment
of the run (then shrinks it with pngquant when installed). Every process it starts is stopped
by its PID. The binary: $SLACKGATE_BIN, else
target/release/slackgate.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "live-screenshot-token"

# name, scenario, time scale, stub args, seconds into the drill for the shot, gate TOML body
RUNS = [
    ("live-seed-003", "scenarios/seed-003-probe-burst.toml", 0.5,
     ["--slots", "1", "--latency", "tokens:prefill_us=0,decode_us=5000"], 4.0, """
[[pools]]
name = "default"
slots = 1
upstream = "UPSTREAM"
[pools.prior]
overhead_ms = 0
prefill_ms_per_token = 0
decode_ms_per_token = 5
[[classes]]
name = "prod"
priority = 100
deadline_ms = 2000
[[classes]]
name = "probe"
priority = 10
max_queue_age_ms = 250
"""),
    ("live-seed-000", "scenarios/seed-000-burst.toml", 0.1,
     ["--slots", "4", "--latency", "tokens:prefill_us=0,decode_us=5000"], 22.0, """
[[pools]]
name = "default"
slots = 4
upstream = "UPSTREAM"
[pools.prior]
overhead_ms = 0
prefill_ms_per_token = 0
decode_ms_per_token = 5
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 6000
"""),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(url: str, timeout: float = 15.0) -> None:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} never answered 200")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def shoot(binary: str, out: Path, run) -> Path:
    name, scenario, scale, stub_args, at_s, pools = run
    tmp = Path(tempfile.mkdtemp(prefix=f"slackgate-{name}-"))
    stub_port, gate_port, admin_port = free_port(), free_port(), free_port()
    (tmp / "token").write_text(TOKEN)
    config = f"""
[server]
listen = "127.0.0.1:{gate_port}"
trust_size_hint = true
tick_ms = 10
[log]
path = "off"
[admin]
listen = "127.0.0.1:{admin_port}"
token_file = "{tmp / 'token'}"
live_frame_ms = 500
""" + pools.replace("UPSTREAM", f"http://127.0.0.1:{stub_port}")
    (tmp / "gate.toml").write_text(config)
    procs = []
    try:
        procs.append(subprocess.Popen([binary, "stub", "--listen", f"127.0.0.1:{stub_port}",
                                       *stub_args], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        wait_ok(f"http://127.0.0.1:{stub_port}/health")
        procs.append(subprocess.Popen([binary, "serve", "--config", str(tmp / "gate.toml")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_ok(f"http://127.0.0.1:{gate_port}/healthz")
        with sync_playwright() as p:
            args = ["--no-sandbox"] if os.geteuid() == 0 else []
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                        args=args)
            page = browser.new_page(viewport={"width": 1000, "height": 800})
            page.goto(f"http://127.0.0.1:{admin_port}/live?token={TOKEN}")
            drill = subprocess.Popen(
                [binary, "drill", str(ROOT / scenario), "--gate", f"http://127.0.0.1:{gate_port}",
                 "--upstream", f"http://127.0.0.1:{stub_port}", "--run", "on",
                 "--time-scale", str(scale)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(drill)
            time.sleep(at_s)
            shot = out / f"{name}.png"
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
        # Small files for the docs: a palette PNG (Debian's pngquant), when it is installed.
        if shutil.which("pngquant"):
            subprocess.run(["pngquant", "--force", "--quality", "70-95", "--output", str(shot),
                            str(shot)], check=False)
        return shot
    finally:
        for proc in reversed(procs):
            stop(proc)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "img"
    out.mkdir(parents=True, exist_ok=True)
    binary = os.environ.get("SLACKGATE_BIN") or str(ROOT / "target" / "release" / "slackgate")
    for run in RUNS:
        print(shoot(binary, out, run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
