"""The gate's /metrics output parsed and linted by Prometheus's own tool.

A scrape that Prometheus rejects is a page that never fires: run real traffic (admitted,
streamed, rejected, malformed) through a live gate, then `promtool check metrics` the result.
"""
import json
import shutil
import subprocess
import urllib.request

import pytest

from test_openai_sdk import MESSAGES, SIMPLE_CONFIG


def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_metrics_pass_promtool(gate_stack):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: scripts/test.sh installs Debian's prometheus "
                    "package (apt-get install -y prometheus)", pytrace=False)
    stack = gate_stack(SIMPLE_CONFIG, stub_latency="tokens:prefill_us=0,decode_us=2000")
    url = f"{stack.gate_url}/v1/chat/completions"
    hdrs = {"content-type": "application/json", "x-job-class": "interactive"}
    ok = json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 4}).encode()
    streamed = json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 4,
                           "stream": True}).encode()
    assert _post(url, ok, hdrs) == 200
    assert _post(url, streamed, hdrs) == 200
    assert _post(url, b"{not json", hdrs) == 400
    assert _post(url, ok, {**hdrs, "x-deadline-ms": "-1"}) == 400

    with urllib.request.urlopen(f"{stack.gate_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in ("slackgate_decisions_total", "slackgate_queue_oldest_age_seconds",
                   "slackgate_in_flight", "slackgate_turnaround_seconds_bucket",
                   "slackgate_time_to_first_token_seconds_bucket"):
        assert family in text, family
    check = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                           capture_output=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    # promtool prints lint findings (naming, units, counters without _total) even when it
    # exits 0; a clean scrape prints nothing.
    assert check.stdout.strip() == "" and check.stderr.strip() == "", check.stdout + check.stderr
