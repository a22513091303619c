"""The reservation ledger as the official OpenAI Python SDK sees it, through the proxy, over
real HTTP (issue 3: "the same duplicate and retry-cap behaviour through the proxy path, tested
with the openai Python SDK's own retries against a gate that rejects").

Every admitted request holds tokens under its idempotency key (`Idempotency-Key`); the SDK's
`x-stainless-retry-count` is the attempt number. These tests prove, with the SDK's own retry
loop and its own exception types:

- the SDK's retries are counted as attempts: over `[ledger] retry_cap` the gate answers 429
  `reject_retry_cap` with `x-should-retry: false`, and the SDK stops there;
- a replay of a held or done key is a 409 `reject_duplicate` (`openai.ConflictError`) after ONE
  attempt, and never reaches the model server;
- tokens are accounted from the upstream's own usage (JSON bodies and streams, where the gate
  asks for `stream_options.include_usage` itself), and a client that leaves mid-stream is a
  `cancel` with the tokens generated for nobody counted as wasted.

Each test runs against a fresh stub and gate (conftest.py's `gate_stack`), with an in-memory
or SQLite ledger in the test's tmp_path. Run with scripts/test-python.sh.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import AttemptRecorder

MESSAGES = [{"role": "user", "content": "Say something short."}]


def admission_stats(stack) -> dict:
    """The ledger's totals (`GET /admission/v1/stats`)."""
    r = httpx.get(f"{stack.gate_url}/admission/v1/stats", timeout=5.0)
    r.raise_for_status()
    return r.json()


def key_lines(lines: list[dict], key: str) -> list[dict]:
    return sorted((l for l in lines if l.get("idempotency_key") == key), key=lambda l: l["seq"])


# ---------------------------------------------------------------------------------------------
# a. The SDK's retries are attempts: the third one is over the cap and stops the SDK.
# ---------------------------------------------------------------------------------------------

# One slot, every request estimated at 400 ms (pinned). An interactive request must finish
# within 550 ms, so its slack is 150 ms. Two patient requests (x-deadline-ms: 60000) take the
# slot (the stub holds it) and the one queue place ahead: the projected wait of a new request is
# then the queued job's 400 ms plus what is left of the running one (never under 400 / 8), always
# over the slack. Every attempt is refused with projected_wait_exceeds_slack, a short
# retry-after-ms (wait minus slack, ~300-800 ms, plus jitter) and x-should-retry: true.
# retry_cap = 1 lets attempts 0 and 1 reach that decision; attempt 2 is refused by the ledger
# first (reject_retry_cap, x-should-retry: false).
RETRY_CAP_CONFIG = """
[server]
listen = "$listen"
ledger = "memory"

[log]
path = "$log"

[ledger]
retry_cap = 1

[[pools]]
name = "gpu"
slots = 1
upstream = "$upstream"
prior = { overhead_ms = 400, prefill_ms_per_token = 0, decode_ms_per_token = 0, learn = false }

[[classes]]
name = "interactive"
priority = 100
deadline_ms = 550
pool = "gpu"

[retry]
min_retry_after_ms = 100
max_useful_retry_after_ms = 30000
"""


def test_sdk_retries_count_as_attempts_up_to_retry_cap(gate_stack):
    stack = gate_stack(RETRY_CAP_CONFIG, stub_slots=1, stub_latency="fixed:20ms")
    key = f"sdk-retry-cap-{uuid.uuid4().hex[:12]}"

    patient = {"x-job-class": "interactive", "x-deadline-ms": "60000"}
    with ThreadPoolExecutor(max_workers=2) as pool:
        try:
            # The occupant (held by the stub in its only slot) and one job queued behind it.
            occupant, queued = stack.occupy_and_queue(pool, patient)

            rec = AttemptRecorder()
            client = stack.client(max_retries=3, recorder=rec)
            t0 = time.monotonic()
            with pytest.raises(openai.RateLimitError) as excinfo:
                client.chat.completions.create(
                    model="stub-model", messages=MESSAGES, max_tokens=4,
                    extra_headers={"x-job-class": "interactive", "Idempotency-Key": key},
                )
            elapsed = time.monotonic() - t0
        finally:
            stack.release_stub("occupant")
        served = [occupant.result(timeout=15), queued.result(timeout=15)]
    assert all(r.choices[0].message.content for r in served)

    # max_retries=3 would allow four attempts; the SDK made exactly three, because the third
    # answer said x-should-retry: false.
    assert [a.retry_count for a in rec.attempts] == ["0", "1", "2"], rec.attempts
    assert [a.status for a in rec.attempts] == [429, 429, 429]
    reasons = [a.headers["x-slackgate-reason"] for a in rec.attempts]
    assert reasons == ["projected_wait_exceeds_slack", "projected_wait_exceeds_slack",
                       "reject_retry_cap"], reasons
    assert [a.headers["x-should-retry"] for a in rec.attempts] == ["true", "true", "false"]
    # The refusals that could be retried asked for a short wait, and the SDK honoured it.
    advertised = [int(a.headers["retry-after-ms"]) for a in rec.attempts[:2]]
    assert all(100 <= ms <= 2000 for ms in advertised), advertised
    for i, ms in enumerate(advertised):
        gap = rec.attempts[i + 1].sent_at - rec.attempts[i].received_at
        assert gap >= ms / 1000 - 0.005, f"retry {i + 1} after {gap:.3f}s, gate asked {ms} ms"
    assert elapsed < sum(advertised) / 1000 + 5.0, elapsed

    # The SDK raised the last answer: a RateLimitError whose code is the gate's reason.
    err = excinfo.value
    assert err.status_code == 429
    assert err.code == "reject_retry_cap"
    assert err.type == "admission_rejected"
    doc = err.response.json()
    assert doc["error"]["code"] == "reject_retry_cap"
    assert doc["admission"]["reason"] == "reject_retry_cap"
    assert doc["admission"]["idempotency_key"] == key
    assert doc["admission"]["ledger"]["attempt"] == 2
    assert doc["admission"]["ledger"]["retry_cap"] == 1
    assert err.response.headers["x-should-retry"] == "false"

    # The decision log numbers the three attempts of that key 0, 1, 2, with those reasons.
    lines = stack.wait_log(lambda ls: len(key_lines(ls, key)) >= 3)
    mine = key_lines(lines, key)
    assert [(l["action"], l["attempt"], l["reason"]) for l in mine] == [
        ("reject", 0, "projected_wait_exceeds_slack"),
        ("reject", 1, "projected_wait_exceeds_slack"),
        ("reject", 2, "reject_retry_cap"),
    ], mine
    assert all(l["status"] == 429 for l in mine)
    # Nothing was reserved for the key (the two patient requests were served and settled),
    # and the model server never saw it.
    stats = admission_stats(stack)
    assert stats["held"] == 0 and stats["tokens_held"] == 0 and stats["done"] == 2
    assert stack.stub_stats()["requests"] == 2


# ---------------------------------------------------------------------------------------------
# b. A replay of a held or done key: 409 after one attempt, never sent upstream.
# ---------------------------------------------------------------------------------------------

LEDGER_CONFIG = """
default_class = "interactive"

[server]
listen = "$listen"
ledger = "ledger.db"

[log]
path = "$log"

[[pools]]
name = "default"
slots = 4
upstream = "$upstream"

[[classes]]
name = "interactive"
priority = 100
deadline_ms = 20000
pool = "default"
"""


def test_duplicate_key_is_conflict_after_one_attempt(gate_stack, tmp_path):
    stack = gate_stack(LEDGER_CONFIG, stub_latency="fixed:20ms")
    key = f"sdk-dup-{uuid.uuid4().hex[:12]}"
    headers = {"Idempotency-Key": key}

    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            first = pool.submit(
                stack.client(max_retries=0).chat.completions.with_raw_response.create,
                model="stub-model", messages=MESSAGES, max_tokens=6,
                extra_headers={**headers, "x-stub-hold": "first"},
            )
            stack.wait_gate(lambda s: s["gate"]["pools"][0]["in_flight"] == 1, "first in flight")
            assert stack.stub_stats()["in_flight"] == 1

            # While the first holds its tokens: a replay, even with the SDK's retries on.
            rec = AttemptRecorder()
            t0 = time.monotonic()
            with pytest.raises(openai.ConflictError) as held_exc:
                stack.client(max_retries=2, recorder=rec).chat.completions.create(
                    model="stub-model", messages=MESSAGES, max_tokens=6, extra_headers=headers)
            elapsed = time.monotonic() - t0
            held_tokens = admission_stats(stack)["tokens_held"]
        finally:
            stack.release_stub("first")
        raw = first.result(timeout=15)
    done = raw.parse()
    assert done.choices[0].message.content and done.usage.completion_tokens == 6

    # One attempt: x-should-retry: false, no backoff sleep.
    assert len(rec.attempts) == 1, rec.attempts
    assert rec.attempts[0].retry_count == "0"
    assert elapsed < 1.0, f"took {elapsed:.3f}s: the SDK waited or retried"
    err = held_exc.value
    assert err.status_code == 409
    assert err.code == "reject_duplicate"
    assert err.response.headers["x-should-retry"] == "false"
    adm = err.response.json()["admission"]
    assert adm["reason"] == "reject_duplicate" and adm["action"] == "reject"
    assert adm["idempotency_key"] == key
    assert adm["ledger"]["state"] == "held"
    assert adm["ledger"]["tokens_held"] > 0
    # The tokens the replay was told about are exactly the first request's hold.
    assert adm["ledger"]["tokens_held"] == held_tokens

    # After the first completed, the key is done: a third request is refused the same way.
    with pytest.raises(openai.ConflictError) as done_exc:
        stack.client(max_retries=2).chat.completions.create(
            model="stub-model", messages=MESSAGES, max_tokens=6, extra_headers=headers)
    adm = done_exc.value.response.json()["admission"]
    assert done_exc.value.code == "reject_duplicate"
    assert adm["ledger"]["state"] == "done"
    assert adm["ledger"]["tokens_held"] == held_tokens

    # The model server saw the first request only.
    assert stack.stub_stats()["requests"] == 1

    job_id = int(raw.headers["x-slackgate-job-id"])
    lines = stack.wait_log(lambda ls: sum(
        l.get("idempotency_key") == key for l in ls) >= 5)
    mine = key_lines(lines, key)
    # admit (within_slack, or estimator_warmup on a fresh pool), dispatch, the refused replay
    # while it ran, its completion, the refused replay after it.
    assert [l["action"] for l in mine] == ["admit", "dispatch", "reject", "complete", "reject"], mine
    assert [l["reason"] for l in mine][1:] == [
        "slot_free", "reject_duplicate", "completed", "reject_duplicate"], mine
    complete = [l for l in mine if l["action"] == "complete"]
    assert len(complete) == 1 and complete[0]["job_id"] == job_id
    assert complete[0]["tokens_spent"] == done.usage.total_tokens

    # The durable ledger agrees: one row for the key, done, spent once.
    stats = admission_stats(stack)
    assert stats["held"] == 0 and stats["done"] == 1
    assert stats["tokens_spent"] == done.usage.total_tokens


# ---------------------------------------------------------------------------------------------
# c. Tokens accounted: JSON and streamed responses spend the upstream's usage; a client that
#    leaves mid-stream wastes what was generated for it.
# ---------------------------------------------------------------------------------------------

# The stub decodes one token every 20 ms, so a 60-token stream takes 1.2 s: long enough to
# leave in the middle of it.
ACCOUNTING_CONFIG = LEDGER_CONFIG


def test_tokens_spent_match_usage_and_disconnect_is_wasted(gate_stack):
    stack = gate_stack(ACCOUNTING_CONFIG, stub_latency="tokens:prefill_us=0,decode_us=20000")
    client = stack.client(max_retries=0)
    before = admission_stats(stack)
    assert before["tokens_spent"] == 0 and before["tokens_wasted"] == 0

    # 1. Non-streaming.
    k_json = f"acct-json-{uuid.uuid4().hex[:8]}"
    resp = client.chat.completions.create(
        model="stub-model", messages=MESSAGES, max_tokens=7,
        extra_headers={"Idempotency-Key": k_json})
    assert resp.usage.completion_tokens == 7
    json_total = resp.usage.total_tokens

    # 2. Streaming, without asking for usage: the gate asks the upstream for it
    #    (stream_options.include_usage), and passes the final usage chunk on.
    k_stream = f"acct-stream-{uuid.uuid4().hex[:8]}"
    stream = client.chat.completions.create(
        model="stub-model", messages=MESSAGES, max_tokens=9, stream=True,
        extra_headers={"Idempotency-Key": k_stream})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(pieces) == 9
    assert usage is not None, "the gate did not ask the upstream for the usage chunk"
    assert usage.completion_tokens == 9
    stream_total = usage.total_tokens

    # The ledger spent exactly the upstream's usage, and nothing was wasted.
    after = stack.wait_log(lambda ls: sum(l["action"] == "complete" for l in ls) >= 2)
    by_key = {l["idempotency_key"]: l for l in after if l["action"] == "complete"}
    assert by_key[k_json]["tokens_spent"] == json_total
    assert by_key[k_stream]["tokens_spent"] == stream_total
    assert by_key[k_json]["tokens_wasted"] == 0 and by_key[k_stream]["tokens_wasted"] == 0
    assert all(by_key[k]["reason"] == "completed" and by_key[k]["status"] == 200
               for k in (k_json, k_stream))
    stats = admission_stats(stack)
    assert stats["tokens_spent"] == json_total + stream_total
    assert stats["tokens_wasted"] == 0
    assert stats["done"] == 2 and stats["held"] == 0 and stats["tokens_held"] == 0
    assert stats["amplification"] == pytest.approx(1.0)

    # 3. A client that leaves mid-stream: 60 tokens at 20 ms each; it reads 3 and hangs up.
    k_gone = f"acct-gone-{uuid.uuid4().hex[:8]}"
    stream = client.chat.completions.create(
        model="stub-model", messages=MESSAGES, max_tokens=60, stream=True,
        extra_headers={"Idempotency-Key": k_gone})
    seen = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            seen += 1
            if seen == 3:
                break
    stream.close()  # closes the HTTP response: the connection goes away

    lines = stack.wait_log(lambda ls: any(
        l["action"] == "cancel" and l["idempotency_key"] == k_gone for l in ls), timeout=10)
    cancel = [l for l in lines if l["action"] == "cancel" and l["idempotency_key"] == k_gone]
    assert len(cancel) == 1, cancel
    c = cancel[0]
    assert c["reason"] == "client_cancelled"
    assert c["tokens_spent"] == 0
    # At least the 3 tokens the client read were generated for nobody; far fewer than 60.
    assert 3 <= c["tokens_wasted"] < 60, c
    assert not any(l["action"] == "complete" and l["idempotency_key"] == k_gone for l in lines)

    stats = admission_stats(stack)
    assert stats["tokens_spent"] == json_total + stream_total  # unchanged
    assert stats["tokens_wasted"] == c["tokens_wasted"]
    assert stats["cancelled"] == 1 and stats["held"] == 0 and stats["tokens_held"] == 0
    assert stats["amplification"] == pytest.approx(
        (json_total + stream_total + c["tokens_wasted"]) / (json_total + stream_total))
    # The upstream request was cancelled too, not left generating.
    deadline = time.monotonic() + 5
    while stack.stub_stats()["cancelled"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.stub_stats()["cancelled"] == 1


def test_duplicate_log_line_has_the_status_answered(gate_stack):
    stack = gate_stack(LEDGER_CONFIG, stub_latency="fixed:20ms")
    key = f"sdk-dup-status-{uuid.uuid4().hex[:12]}"
    client = stack.client(max_retries=0)
    client.chat.completions.create(model="stub-model", messages=MESSAGES, max_tokens=2,
                                   extra_headers={"Idempotency-Key": key})
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(model="stub-model", messages=MESSAGES, max_tokens=2,
                                       extra_headers={"Idempotency-Key": key})
    lines = stack.wait_log(lambda ls: any(l["action"] == "reject" for l in ls))
    refused = [l for l in lines if l["action"] == "reject"]
    assert [l["status"] for l in refused] == [409], refused


# ---------------------------------------------------------------------------------------------
# Known gateway bug: a stream the SDK closes at `data: [DONE]` is settled as cancelled.
# ---------------------------------------------------------------------------------------------


class SlowEndUpstream:
    """A minimal OpenAI-compatible upstream (one thread per connection, 127.0.0.1 only) whose
    SSE answer sends every chunk, the usage chunk and `data: [DONE]`, and only then, END_DELAY_S
    later, the end of the chunked body. Real servers can do this (they flush [DONE] before they
    finish the request); the official SDK stops reading at [DONE] and closes the response."""

    END_DELAY_S = 0.5

    def __init__(self) -> None:
        import http.server
        import json as _json
        import threading

        outer = self
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", 0))
                self.rfile.read(n)
                outer.requests += 1
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()

                def send(obj) -> None:
                    text = obj if isinstance(obj, str) else _json.dumps(obj)
                    data = f"data: {text}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()

                base = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
                send({**base, "choices": [{"index": 0, "delta": {"role": "assistant"},
                                           "finish_reason": None}]})
                for i in range(3):
                    send({**base, "choices": [{"index": 0, "delta": {"content": f"t{i} "},
                                               "finish_reason": None}]})
                send({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                send({**base, "choices": [], "usage": {
                    "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
                send("[DONE]")
                time.sleep(outer.END_DELAY_S)
                try:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except OSError:
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_stream_closed_at_done_is_spent_once(gate_stack):
    upstream = SlowEndUpstream()
    try:
        config = LEDGER_CONFIG.replace('upstream = "$upstream"', f'upstream = "{upstream.url}"')
        stack = gate_stack(config)
        client = stack.client(max_retries=0)
        key = f"sdk-done-close-{uuid.uuid4().hex[:8]}"
        headers = {"Idempotency-Key": key}

        chunks = list(client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, extra_headers=headers))
        assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 8
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "t0 t1 t2 "

        lines = stack.wait_log(lambda ls: any(
            l["idempotency_key"] == key and l["action"] in ("complete", "cancel") for l in ls))
        end = [l for l in lines
               if l["idempotency_key"] == key and l["action"] in ("complete", "cancel")]
        stats = admission_stats(stack)
        replay_status = None
        try:
            client.chat.completions.create(
                model="m", messages=MESSAGES, stream=True, extra_headers=headers).close()
            replay_status = 200
        except openai.APIStatusError as e:
            replay_status = e.status_code
        time.sleep(0.2)
        upstream_requests = upstream.requests
        # What a fixed gate does: the delivered answer is spent, once.
        assert [(l["action"], l["tokens_spent"]) for l in end] == [("complete", 8)], end
        assert stats["done"] == 1 and stats["cancelled"] == 0, stats
        assert stats["tokens_spent"] == 8 and stats["tokens_wasted"] == 0, stats
        assert replay_status == 409, "the replay of a delivered stream was admitted again"
        assert upstream_requests == 1
    finally:
        upstream.close()
