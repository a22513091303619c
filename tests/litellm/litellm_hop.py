#!/usr/bin/env python3
"""LiteLLM in front of the gate, the gate in front of the stub: a real LiteLLM proxy, a real
gate and the stub, each a process on a free loopback port, every wait bounded.

    python tests/litellm/litellm_hop.py      (scripts/test-litellm.sh runs it in LiteLLM's venv)

The recipe under test (docs/deployment.md, "LiteLLM in front"): LiteLLM's
`general_settings.forward_client_headers_to_llm_api: true` and `litellm_settings.num_retries:
0`. Checked, and printed:

1. the class and deadline headers a client sends LiteLLM reach the gate (its decision line);
2. a refusal reaches the client as a 429, with the gate's Retry-After and reason under the
   names LiteLLM gives them (`llm_provider-retry-after`, ...), each refusal decided once by
   the gate (no retry by LiteLLM multiplies it);
3. a stream passes through chunk by chunk, ending with [DONE], settled on its usage.

SLACKGATE_BIN names the gate binary (else target/release/slackgate under CARGO_TARGET_DIR or
the checkout). Exits non-zero, saying what failed, on any failure.
"""
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MASTER_KEY = "sk-litellm-master-for-tests"


_GIVEN = set()


def free_port():
    """A port free a moment ago and never handed out before in this run: the OS may give a
    port it just freed again (a CI run once gave the gate's port to LiteLLM as well)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def wait_http(url, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"litellm-hop: FAILED: {what} did not answer {url} within {seconds} s")


def fail(msg):
    raise SystemExit(f"litellm-hop: FAILED: {msg}")


def gate_config(stub_port):
    # One slot, a 300 ms stub and priors that know it: a request with a 450 ms deadline
    # behind another is refused at once (projected_wait_exceeds_slack).
    return f"""
default_class = "interactive"
[server]
ledger = "memory"
[[pools]]
name = "default"
slots = 1
upstream = "http://127.0.0.1:{stub_port}"
[pools.prior]
overhead_ms = 300.0
prefill_ms_per_token = 0.0
decode_ms_per_token = 0.0
batch_slowdown = 0.0
learn = false
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 10000
[[classes]]
name = "batch"
priority = 10
"""


def litellm_config(gate_port):
    return f"""
model_list:
  - model_name: demo
    litellm_params:
      model: openai/demo
      api_base: http://127.0.0.1:{gate_port}/v1
      api_key: sk-upstream-key-the-gate-sees
litellm_settings:
  num_retries: 0             # a refusal is the gate's answer: not retried, not multiplied
general_settings:
  master_key: {MASTER_KEY}
  forward_client_headers_to_llm_api: true   # X-Job-Class, X-Deadline-Ms, ... reach the gate
"""


class Lines:
    """The gate's decision log, read as it grows."""

    def __init__(self, path):
        self.path = path

    def all(self):
        try:
            with open(self.path) as f:
                return [json.loads(l) for l in f if l.strip()]
        except FileNotFoundError:
            return []

    def wait(self, pred, seconds, what):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = [l for l in self.all() if pred(l)]
            if found:
                return found
            time.sleep(0.05)
        fail(f"no decision line: {what}")


def chat(client, url, headers, body):
    h = {"authorization": f"Bearer {MASTER_KEY}", "content-type": "application/json"}
    h.update(headers)
    return client.post(url, headers=h, content=json.dumps(body), timeout=30)


BODY = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def check_headers_reach_the_gate(client, url, log):
    r = chat(client, url, {"x-job-class": "batch", "x-deadline-ms": "5000"}, BODY)
    if r.status_code != 200:
        fail(f"a plain request through LiteLLM answered {r.status_code}: {r.text[:300]}")
    job = int(r.headers["llm_provider-x-slackgate-job-id"])
    admit = log.wait(lambda l: l["action"] == "admit" and l["job_id"] == job, 10, "admit")[0]
    if admit["class"] != "batch":
        fail(f"X-Job-Class did not reach the gate: class {admit['class']}")
    # batch has no default deadline: a slack means the client's X-Deadline-Ms arrived.
    slack = admit["deadline_slack_ms"]
    if slack is None or not 3000 <= slack <= 5000:
        fail(f"X-Deadline-Ms did not reach the gate: deadline_slack_ms {slack}")
    print(f"litellm-hop: headers: class {admit['class']}, deadline_slack_ms {slack} "
          f"(X-Deadline-Ms 5000, 300 ms of service) at the gate")


def check_refusals(client, url, log):
    before = len(log.all())
    headers = {"x-job-class": "interactive", "x-deadline-ms": "450"}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: chat(client, url, headers, BODY), range(3)))
    refused = [r for r in answers if r.status_code == 429]
    if not refused or not any(r.status_code == 200 for r in answers):
        fail(f"expected one 200 and 429s, got {[r.status_code for r in answers]}")
    time.sleep(0.5)
    rejects = [l for l in log.all()[before:] if l["action"] == "reject"]
    if len(rejects) != len(refused):
        fail(f"{len(refused)} refusals reached clients, the gate decided {len(rejects)}: "
             "LiteLLM retried them")
    r = refused[0]
    after = r.headers.get("retry-after") or r.headers.get("llm_provider-retry-after")
    if after is None:
        fail(f"no Retry-After under any name: {dict(r.headers)}")
    reason = r.headers.get("llm_provider-x-slackgate-reason")
    if reason != "projected_wait_exceeds_slack":
        fail(f"the gate's reason did not reach the client: {reason}")
    names = sorted(k for k in r.headers if "retry" in k or "slackgate" in k or "dropped" in k)
    print(f"litellm-hop: refusal: {len(refused)} x 429 to the client, {len(rejects)} gate "
          f"decisions (attempts {[l['attempt'] for l in rejects]}); headers {names}; "
          f"plain Retry-After: {r.headers.get('retry-after')}; body: {r.text[:160]}")


def check_stream(client, url, log):
    h = {"authorization": f"Bearer {MASTER_KEY}", "content-type": "application/json",
         "x-job-class": "batch"}
    body = dict(BODY, stream=True)
    chunks, done, first_at, t0 = 0, False, None, time.monotonic()
    with client.stream("POST", url, headers=h, content=json.dumps(body), timeout=30) as r:
        if r.status_code != 200:
            fail(f"stream answered {r.status_code}")
        job = int(r.headers["llm_provider-x-slackgate-job-id"])
        for line in r.iter_lines():
            if line.startswith("data: [DONE]"):
                done = True
            elif line.startswith("data: "):
                chunks += 1
                first_at = first_at or time.monotonic() - t0
    if chunks < 4 or not done:
        fail(f"stream: {chunks} chunks, [DONE] {done}")
    complete = log.wait(lambda l: l["action"] == "complete" and l["job_id"] == job, 10,
                        "the stream's complete line")[0]
    if complete["status"] != 200 or not complete["tokens_spent"]:
        fail(f"stream not settled on its usage: {complete}")
    print(f"litellm-hop: stream: {chunks} chunks then [DONE], first after {first_at:.2f} s; "
          f"the gate settled {complete['tokens_spent']} tokens")


def main():
    # `timeout` ends this run with SIGTERM: turn it into SystemExit, so the tails are printed
    # and every process started here is stopped (Python's default would skip `finally`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("litellm-hop: terminated (SIGTERM)"))
    binary = os.environ.get("SLACKGATE_BIN") or os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "slackgate")
    litellm = os.path.join(os.path.dirname(sys.executable), "litellm")
    if not os.access(binary, os.X_OK):
        fail(f"no slackgate binary at {binary}")
    if not os.access(litellm, os.X_OK):
        fail(f"no litellm beside {sys.executable} (scripts/test-litellm.sh installs it)")
    work = tempfile.mkdtemp(prefix="slackgate-litellm-")
    stub_port, gate_port, proxy_port = free_port(), free_port(), free_port()
    with open(os.path.join(work, "gate.toml"), "w") as f:
        f.write(gate_config(stub_port))
    with open(os.path.join(work, "litellm.yaml"), "w") as f:
        f.write(litellm_config(gate_port))
    env = dict(os.environ, LITELLM_MASTER_KEY=MASTER_KEY, LITELLM_LOCAL_MODEL_COST_MAP="True",
               LITELLM_LOG="ERROR")
    procs = []
    started = time.monotonic()
    try:
        def spawn(name, args, **kw):
            out = open(os.path.join(work, f"{name}.log"), "w")
            # Each in a session of its own: stopping it stops its children too (LiteLLM's
            # server workers).
            procs.append((name, subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL,
                                                 start_new_session=True, **kw), out))
        spawn("stub", [binary, "stub", "--listen", f"127.0.0.1:{stub_port}", "--slots", "1",
                       "--latency", "fixed:300ms"])
        log_path = os.path.join(work, "decisions.jsonl")
        spawn("gate", [binary, "serve", "--config", os.path.join(work, "gate.toml"),
                       "--listen", f"127.0.0.1:{gate_port}", "--log", log_path])
        spawn("litellm", [litellm, "--config", os.path.join(work, "litellm.yaml"),
                          "--host", "127.0.0.1", "--port", str(proxy_port)], env=env)
        wait_http(f"http://127.0.0.1:{gate_port}/readyz", 20, "the gate")
        wait_http(f"http://127.0.0.1:{proxy_port}/health/liveliness", 90, "LiteLLM")
        print(f"litellm-hop: stub, gate and LiteLLM up in {time.monotonic() - started:.1f} s")
        url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
        log = Lines(log_path)
        with httpx.Client() as client:
            check_headers_reach_the_gate(client, url, log)
            check_refusals(client, url, log)
            check_stream(client, url, log)
    except (SystemExit, Exception):
        for name, _, out in procs:
            out.flush()
            with open(out.name) as f:
                print(f"--- {name}.log (tail)\n" + "".join(f.readlines()[-15:]), file=sys.stderr)
        raise
    finally:
        for _, p, _ in procs:
            stop(p, signal.SIGTERM)
        for _, p, out in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                stop(p, signal.SIGKILL)
                p.wait(timeout=5)
            out.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"litellm-hop: ok in {time.monotonic() - started:.1f} s")


def stop(p, sig):
    """Signal the process group a child leads (it was started in a session of its own)."""
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    main()
