"""The gate as the official OpenAI Python SDK sees it, over real HTTP.

Each test writes the gate configuration it runs with, in full, so the tests double as
examples of configurations and of what a client observes. `$listen`, `$upstream` and `$log`
are filled in by the `gate_stack` fixture (conftest.py) with a free port, the stub's URL and a
decision-log file in the test's tmp_path.

Run with scripts/test-python.sh (builds the binary, makes .venv, runs pytest).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import AttemptRecorder

MESSAGES = [{"role": "user", "content": "Say something short."}]


def lines_for(lines: list[dict], job_id: int) -> list[dict]:
    return [l for l in lines if l["job_id"] == job_id]


# ---------------------------------------------------------------------------------------------
# 1. A normal request goes through and comes back with content and usage.
# ---------------------------------------------------------------------------------------------

SIMPLE_CONFIG = """
default_class = "interactive"

[server]
listen = "$listen"

[log]
path = "$log"

[[pools]]
name = "default"
slots = 2
upstream = "$upstream"

[[classes]]
name = "interactive"
aliases = ["chat"]
priority = 100
deadline_ms = 10000
pool = "default"
"""


def test_chat_completion_returns_content_and_usage(gate_stack):
    stack = gate_stack(SIMPLE_CONFIG, stub_latency="fixed:50ms")
    client = stack.client(max_retries=0)

    raw = client.chat.completions.with_raw_response.create(
        model="stub-model",
        messages=MESSAGES,
        max_tokens=8,
        extra_headers={"x-job-class": "chat"},
    )
    resp = raw.parse()

    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content and resp.choices[0].message.content.strip()
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    # The gate says what it decided, in headers the SDK exposes.
    assert raw.headers["x-slackgate-decision"] == "admit"
    assert raw.headers["x-slackgate-reason"] == "within_slack"
    job_id = int(raw.headers["x-slackgate-job-id"])

    # One line per transition: admit, dispatch, complete; the alias resolves to its class, the
    # SDK's retry counter is the attempt, and the tokens spent are the upstream's usage.
    lines = stack.wait_log(lambda ls: any(
        l["job_id"] == job_id and l["action"] == "complete" for l in ls))
    mine = lines_for(lines, job_id)
    assert [l["action"] for l in mine] == ["admit", "dispatch", "complete"], mine
    assert all(l["class"] == "interactive" and l["class_label"] == "chat" for l in mine)
    assert mine[0]["attempt"] == 0
    assert mine[-1]["status"] == 200
    assert mine[-1]["tokens_spent"] == resp.usage.total_tokens


# ---------------------------------------------------------------------------------------------
# 2. Streaming is passed through chunk by chunk, with the final usage chunk.
# ---------------------------------------------------------------------------------------------


def test_streaming_chunks_arrive_over_time_with_usage(gate_stack):
    # The stub decodes one token every 30 ms: 10 tokens take ~300 ms to generate.
    stack = gate_stack(SIMPLE_CONFIG, stub_latency="tokens:prefill_us=0,decode_us=30000")
    client = stack.client(max_retries=0)

    stream = client.chat.completions.create(
        model="stub-model",
        messages=MESSAGES,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-job-class": "interactive"},
    )
    content_times, content, usage_chunks, n_chunks = [], [], [], 0
    for chunk in stream:
        n_chunks += 1
        if chunk.choices and chunk.choices[0].delta.content:
            content_times.append(time.monotonic())
            content.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage_chunks.append(chunk)

    assert len(content) == 10, f"expected one content chunk per token, got {content}"
    spread = content_times[-1] - content_times[0]
    # 9 decode intervals of 30 ms = 270 ms between the first and the last token; a gate that
    # buffered the stream would deliver them all at once (spread ~0).
    assert spread > 0.1, f"chunks arrived within {spread * 1000:.0f} ms: the stream was buffered"
    assert n_chunks >= 12  # 10 tokens + finish chunk + usage chunk

    assert len(usage_chunks) == 1, "exactly one usage chunk expected"
    u = usage_chunks[0]
    assert u.choices == []
    assert u.usage.completion_tokens == 10
    assert u.usage.total_tokens == u.usage.prompt_tokens + 10

    lines = stack.wait_log(lambda ls: any(l["action"] == "complete" for l in ls))
    done = [l for l in lines if l["action"] == "complete"][0]
    assert done["status"] == 200 and done["reason"] == "completed"
    assert done["tokens_spent"] == u.usage.total_tokens
    # Time to first token is well before the end of the response.
    assert done["ttft_ms"] is not None and done["ttft_ms"] < done["turnaround_ms"]


# ---------------------------------------------------------------------------------------------
# 3. A rejection is an openai.RateLimitError carrying the gate's advice and reason.
# ---------------------------------------------------------------------------------------------

# One slot. The estimator is pinned (learn = false) at 2000 ms per request, which is what the
# stub really takes (fixed:2000ms). An interactive request must finish within 2500 ms, so its
# slack is 2500 - 2000 = 500 ms: as soon as one request is running (projected wait ~2000 ms),
# the next one cannot make its deadline and is refused at once instead of queueing.
ONE_SLOT_CONFIG = """
[server]
listen = "$listen"

[log]
path = "$log"

[[pools]]
name = "gpu"
slots = 1
upstream = "$upstream"
prior = { overhead_ms = 2000, prefill_ms_per_token = 0, decode_ms_per_token = 0, learn = false }

[[classes]]
name = "interactive"
priority = 100
deadline_ms = 2500
pool = "gpu"

[retry]
min_retry_after_ms = 1000
max_useful_retry_after_ms = 30000
"""


def test_rejection_is_rate_limit_error_with_reason_and_advice(gate_stack):
    stack = gate_stack(ONE_SLOT_CONFIG, stub_slots=1, stub_latency="fixed:2000ms")
    headers = {"x-job-class": "interactive"}

    with ThreadPoolExecutor(max_workers=1) as pool:
        occupant = pool.submit(
            stack.client(max_retries=0).chat.completions.create,
            model="stub-model", messages=MESSAGES, max_tokens=4, extra_headers=headers,
        )
        stack.wait_gate(lambda s: s["gate"]["pools"][0]["in_flight"] == 1,
                        "the occupant holding the only slot")

        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as excinfo:
            stack.client(max_retries=0).chat.completions.create(
                model="stub-model", messages=MESSAGES, max_tokens=4, extra_headers=headers,
            )
        rejected_in = time.monotonic() - t0
        first = occupant.result(timeout=15)

    err = excinfo.value
    assert err.status_code == 429
    h = err.response.headers
    ms = int(h["retry-after-ms"])
    assert 1000 <= ms <= 30000, ms  # at least min_retry_after_ms, and worth retrying
    assert h["retry-after"] == str(max(1, math.ceil(ms / 1000)))  # whole seconds, rounded up
    assert h["x-should-retry"] == "true"
    assert h["x-slackgate-reason"] == "projected_wait_exceeds_slack"

    # The SDK parses the OpenAI error shape: err.body is the "error" object, err.code the reason.
    assert err.code == "projected_wait_exceeds_slack"
    assert err.type == "admission_rejected"
    assert "projected wait" in err.message
    doc = err.response.json()
    assert doc["error"]["code"] == "projected_wait_exceeds_slack"
    assert doc["error"]["param"] is None
    adm = doc["admission"]
    assert adm["action"] == "reject"
    assert adm["reason"] == "projected_wait_exceeds_slack"
    assert adm["class"] == "interactive"
    assert adm["in_flight"] == 1 and adm["queued_ahead"] == 0
    assert adm["est_service_ms"] == 2000
    assert adm["deadline_slack_ms"] == 500
    assert adm["projected_wait_ms"] > adm["deadline_slack_ms"]
    assert adm["retry_after_ms"] == ms

    # Refused at once, not after waiting in a queue.
    assert rejected_in < 1.0, f"rejection took {rejected_in:.3f}s"
    # Meanwhile the request holding the slot was served normally.
    assert first.choices[0].message.content

    lines = stack.wait_log(lambda ls: any(l["action"] == "reject" for l in ls))
    rejects = [l for l in lines if l["action"] == "reject"]
    assert len(rejects) == 1 and rejects[0]["job_id"] == adm["job_id"]
    assert rejects[0]["status"] == 429


# ---------------------------------------------------------------------------------------------
# 4. The SDK's automatic retries wait as long as the gate asks (retry-after-ms).
# ---------------------------------------------------------------------------------------------

# One slot, every request estimated at 1000 ms (pinned). Two long-running interactive requests
# with a generous per-request deadline (x-deadline-ms: 60000) take the slot and the one queue
# place ahead; the stub holds the first until the test releases it. A new interactive request
# (default deadline 1500 ms, slack 500 ms) would wait at least the queued request's 1000 ms, so
# every attempt is refused with projected_wait_exceeds_slack and a retry-after-ms of 1000 ms
# (min_retry_after_ms) to ~1500 ms, and x-should-retry: true.
BUSY_QUEUE_CONFIG = """
[server]
listen = "$listen"

[log]
path = "$log"

[[pools]]
name = "gpu"
slots = 1
upstream = "$upstream"
prior = { overhead_ms = 1000, prefill_ms_per_token = 0, decode_ms_per_token = 0, learn = false }

[[classes]]
name = "interactive"
priority = 100
deadline_ms = 1500
pool = "gpu"

[retry]
min_retry_after_ms = 1000
max_useful_retry_after_ms = 30000
"""


def test_sdk_retries_wait_for_retry_after_ms(gate_stack):
    stack = gate_stack(BUSY_QUEUE_CONFIG, stub_slots=1, stub_latency="fixed:50ms")
    patient = {"x-job-class": "interactive", "x-deadline-ms": "60000"}

    with ThreadPoolExecutor(max_workers=2) as pool:
        try:
            # The occupant (held by the stub in its only slot) and one job queued behind it.
            running, queued = stack.occupy_and_queue(pool, patient)

            rec = AttemptRecorder()
            client = stack.client(max_retries=2, recorder=rec)
            t0 = time.monotonic()
            with pytest.raises(openai.RateLimitError) as excinfo:
                client.chat.completions.create(
                    model="stub-model", messages=MESSAGES, max_tokens=4,
                    extra_headers={"x-job-class": "interactive"},
                )
            elapsed = time.monotonic() - t0
        finally:
            stack.release_stub("occupant")
        served = [running.result(timeout=15), queued.result(timeout=15)]

    assert all(r.choices[0].message.content for r in served)
    assert excinfo.value.code == "projected_wait_exceeds_slack"

    # Three attempts (max_retries=2), numbered by the SDK's x-stainless-retry-count.
    assert [a.retry_count for a in rec.attempts] == ["0", "1", "2"], rec.attempts
    assert all(a.status == 429 for a in rec.attempts)
    assert all(a.headers["x-should-retry"] == "true" for a in rec.attempts)
    advertised = [int(a.headers["retry-after-ms"]) for a in rec.attempts]
    for ms in advertised[:2]:
        assert 1000 <= ms <= 3000, advertised

    # Each retry came no sooner than the gate asked. (Without retry-after-ms the SDK would back
    # off 0.375-0.5 s, then 0.75-1 s: under 1.5 s in total.)
    gaps = [rec.attempts[i + 1].sent_at - rec.attempts[i].received_at for i in range(2)]
    for gap, ms in zip(gaps, advertised):
        assert gap >= ms / 1000 - 0.005, f"retried after {gap:.3f}s, gate asked {ms} ms"
    waited = sum(advertised[:2]) / 1000
    assert elapsed >= waited, f"create() took {elapsed:.3f}s < advertised {waited:.3f}s"
    assert elapsed < waited + 5.0, f"create() took {elapsed:.3f}s for {waited:.3f}s of waits"
    print(f"\n[retry timing] retry-after-ms={advertised} gaps_s={[round(g, 3) for g in gaps]} "
          f"create()={elapsed:.3f}s sum(advertised waits)={waited:.3f}s")

    # The gate saw the three attempts, numbered 0, 1, 2, each refused.
    lines = stack.wait_log(lambda ls: sum(l["action"] == "reject" for l in ls) >= 3)
    rejects = [l for l in lines if l["action"] == "reject"]
    assert [l["attempt"] for l in rejects] == [0, 1, 2], rejects
    assert all(l["reason"] == "projected_wait_exceeds_slack" for l in rejects)
    assert all(l["class"] == "interactive" for l in rejects)


# ---------------------------------------------------------------------------------------------
# 5. x-should-retry: false stops the SDK after one attempt.
# ---------------------------------------------------------------------------------------------

# No default_class: requests without a known X-Job-Class are refused (reject_unlabeled), and
# the nightly-eval class is switched off (class_disabled). Neither can succeed by retrying
# soon, so the gate answers x-should-retry: false (and a long Retry-After, 60 s).
STRICT_CONFIG = """
[server]
listen = "$listen"

[log]
path = "$log"

[[pools]]
name = "default"
slots = 2
upstream = "$upstream"

[[classes]]
name = "interactive"
priority = 100
deadline_ms = 10000
pool = "default"

[[classes]]
name = "nightly-eval"
priority = 10
pool = "default"
enabled = false

[retry]
hopeless_retry_after_ms = 60000
"""


@pytest.mark.parametrize("label, reason", [
    ("nightly-eval", "class_disabled"),
    (None, "reject_unlabeled"),
])
def test_should_retry_false_stops_sdk_after_one_attempt(gate_stack, label, reason):
    stack = gate_stack(STRICT_CONFIG)
    rec = AttemptRecorder()
    client = stack.client(max_retries=2, recorder=rec)
    headers = {"x-job-class": label} if label else {}

    t0 = time.monotonic()
    with pytest.raises(openai.RateLimitError) as excinfo:
        client.chat.completions.create(
            model="stub-model", messages=MESSAGES, max_tokens=4, extra_headers=headers)
    elapsed = time.monotonic() - t0

    err = excinfo.value
    assert err.code == reason
    assert err.response.headers["x-should-retry"] == "false"
    assert err.response.headers["retry-after-ms"] == "60000"
    assert err.response.headers["retry-after"] == "60"
    assert len(rec.attempts) == 1, rec.attempts
    # No retry, no backoff sleep (the first SDK backoff alone would be >= 0.375 s).
    assert elapsed < 1.0, f"took {elapsed:.3f}s: the SDK waited or retried"

    # A labelled request afterwards is a barrier: once its line is in the log, every earlier
    # line is too (one writer, in order), so the count below is final.
    ok = client.chat.completions.with_raw_response.create(
        model="stub-model", messages=MESSAGES, max_tokens=4,
        extra_headers={"x-job-class": "interactive"})
    ok_id = int(ok.headers["x-slackgate-job-id"])
    lines = stack.wait_log(lambda ls: any(
        l["job_id"] == ok_id and l["action"] == "complete" for l in ls))
    refused = [l for l in lines if l["reason"] == reason]
    assert len(refused) == 1, refused
    assert refused[0]["action"] == "reject" and refused[0]["attempt"] == 0
    assert refused[0]["class_label"] == label
    # The refused request never reached the model server.
    assert stack.stub_stats()["requests"] == 1


# ---------------------------------------------------------------------------------------------
# 6. Streaming through curl (no SDK): the SSE stream is passed through unbuffered.
# ---------------------------------------------------------------------------------------------


def test_curl_streaming_through_gate(gate_stack):
    curl = shutil.which("curl")
    if curl is None:
        pytest.fail("curl is not installed (or not on PATH): this test needs it; "
                    "install curl (e.g. apt-get install -y curl)", pytrace=False)
    stack = gate_stack(SIMPLE_CONFIG, stub_latency="tokens:prefill_us=0,decode_us=30000")
    body = json.dumps({
        "model": "stub-model",
        "messages": MESSAGES,
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
    })
    proc = subprocess.Popen(
        [curl, "-sN", "--max-time", "20", f"{stack.gate_url}/v1/chat/completions",
         "-H", "content-type: application/json", "-H", "x-job-class: interactive",
         "-d", body],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    received: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            received.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=25)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    reader.join(timeout=5)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert rc == 0, f"curl exited {rc}: {stderr}"

    data = [(t, l[len("data: "):]) for t, l in received if l.startswith("data: ")]
    assert len(data) >= 12, received  # 10 tokens, finish, usage, [DONE]
    assert data[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    token_times = [t for (t, _), c in zip(data, chunks)
                   if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(token_times) == 10
    assert token_times[-1] - token_times[0] > 0.1, "curl received the stream all at once"
