"""Fixtures for the end-to-end tests: a real `slackgate stub` (fake model) and a real
`slackgate serve` (the gate), started as subprocesses on free loopback ports.

Every test writes its own gate configuration (TOML) and passes it to the `gate_stack` factory,
with three placeholders the fixture fills in:

    $listen    the gate's listen address (127.0.0.1:PORT)
    $upstream  the stub's base URL (http://127.0.0.1:PORT)
    $log       the decision-log file, inside the test's tmp_path

The binary comes from $SLACKGATE_BIN, or target/release/slackgate under the repository root.
Processes are stopped by PID (SIGTERM, then SIGKILL after a bounded wait) when the test ends,
whether it passed or failed. Only processes these fixtures started are ever signalled.
"""

from __future__ import annotations

import json
import os
import socket
import string
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import httpx
import openai
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


def slackgate_bin() -> Path:
    env = os.environ.get("SLACKGATE_BIN")
    path = Path(env) if env else REPO_ROOT / "target" / "release" / "slackgate"
    if not path.is_absolute():
        path = REPO_ROOT / path
    return path


@pytest.fixture(scope="session")
def binary() -> Path:
    path = slackgate_bin()
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"slackgate binary not found at {path}: run `cargo build --release -p slackgate` "
            "(or scripts/test-python.sh), or point SLACKGATE_BIN at a built binary",
            pytrace=False,
        )
    return path


_GIVEN: set[int] = set()


def free_port() -> int:
    """A port that was free a moment ago (the OS picks it; the caller retries on a clash),
    never one handed out before in this session: the OS may give a port it just freed again,
    and two picks in a row must not name the same port."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


class ProcessGroup:
    """The subprocesses one test started, stopped by PID at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, name: str, argv: list[str]) -> tuple[subprocess.Popen, Path]:
        out = self.tmp_path / f"{name}.out"
        with open(out, "ab") as f:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=self.tmp_path,
            )
        self.procs.append((name, proc, out))
        return proc, out

    def stop_one(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM to exactly this PID
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)

    def stop_all(self) -> None:
        # Gate first (it flushes its decision log on SIGTERM), then the stub.
        for _, proc, _ in reversed(self.procs):
            try:
                self.stop_one(proc)
            except Exception:  # keep stopping the others
                pass


def wait_healthy(proc: subprocess.Popen, out: Path, url: str, what: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with status {proc.returncode} before it was healthy:\n"
                + out.read_text(errors="replace")
            )
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.05)
    raise RuntimeError(
        f"{what} not healthy at {url} within {STARTUP_TIMEOUT_S}s (last: {last}):\n"
        + out.read_text(errors="replace")
    )


def port_clash(e: Exception) -> bool:
    """Whether a start failed because the picked port was taken meanwhile (worth a retry)."""
    return "cannot listen" in str(e) or "in use" in str(e)


@dataclass
class Attempt:
    """One HTTP attempt the SDK made, seen by httpx event hooks."""

    sent_at: float
    retry_count: str | None
    received_at: float | None = None
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)


class AttemptRecorder:
    """httpx event hooks recording each request the SDK sends and each response head it gets."""

    def __init__(self) -> None:
        self.attempts: list[Attempt] = []

    def on_request(self, request: httpx.Request) -> None:
        self.attempts.append(
            Attempt(time.monotonic(), request.headers.get("x-stainless-retry-count"))
        )

    def on_response(self, response: httpx.Response) -> None:
        a = self.attempts[-1]
        a.received_at = time.monotonic()
        a.status = response.status_code
        a.headers = {k.lower(): v for k, v in response.headers.items()}


@dataclass
class GateStack:
    gate_url: str
    stub_url: str
    log_path: Path
    config_path: Path
    procs: ProcessGroup
    _clients: list[httpx.Client] = field(default_factory=list)

    # --- clients -------------------------------------------------------------------------
    def client(self, max_retries: int = 0, timeout: float = 20.0,
               recorder: AttemptRecorder | None = None) -> openai.OpenAI:
        """An official OpenAI SDK client pointed at the gate."""
        hooks = {}
        if recorder is not None:
            hooks = {"request": [recorder.on_request], "response": [recorder.on_response]}
        http_client = openai.DefaultHttpxClient(event_hooks=hooks, timeout=timeout)
        self._clients.append(http_client)
        return openai.OpenAI(
            base_url=f"{self.gate_url}/v1",
            api_key="sk-test-slackgate",
            max_retries=max_retries,
            timeout=timeout,
            http_client=http_client,
        )

    # --- decision log --------------------------------------------------------------------
    def log_lines(self) -> list[dict]:
        if not self.log_path.exists():
            return []
        lines = []
        for raw in self.log_path.read_text().splitlines():
            raw = raw.strip()
            if raw:
                lines.append(json.loads(raw))
        return lines

    def wait_log(self, pred: Callable[[list[dict]], bool], timeout: float = 5.0) -> list[dict]:
        """Poll the decision log (written asynchronously) until pred(lines) holds."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.log_lines()
            if pred(lines):
                return lines
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"decision log condition not met within {timeout}s; log has "
                    f"{len(lines)} lines:\n" + "\n".join(json.dumps(l) for l in lines)
                )
            time.sleep(0.05)

    # --- gate and stub state -------------------------------------------------------------
    def gate_stats(self) -> dict:
        return httpx.get(f"{self.gate_url}/stats", timeout=5.0).json()

    def stub_stats(self) -> dict:
        return httpx.get(f"{self.stub_url}/stub/stats", timeout=5.0).json()

    def wait_gate(self, pred: Callable[[dict], bool], what: str, timeout: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.gate_stats()
            if pred(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"gate never reached: {what} within {timeout}s; /stats: {s}")
            time.sleep(0.02)

    def occupy_and_queue(self, pool, headers: dict) -> tuple:
        """Fill a one-slot pool: an occupant the stub holds (release it with
        release_stub("occupant")) and one request queued behind it. Returns both futures."""
        messages = [{"role": "user", "content": "Say something short."}]
        occupant = pool.submit(
            self.client(max_retries=0).chat.completions.create,
            model="stub-model", messages=messages,
            max_tokens=4, extra_headers={**headers, "x-stub-hold": "occupant"},
        )
        self.wait_gate(lambda s: s["gate"]["pools"][0]["in_flight"] == 1, "slot taken")
        queued = pool.submit(
            self.client(max_retries=0).chat.completions.create,
            model="stub-model", messages=messages, max_tokens=4, extra_headers=headers,
        )
        self.wait_gate(lambda s: s["gate"]["pools"][0]["depth"] == 1, "one job queued")
        return occupant, queued

    def release_stub(self, name: str | None = None) -> int:
        body = {"all": True} if name is None else {"name": name}
        r = httpx.post(f"{self.stub_url}/stub/release", json=body, timeout=5.0)
        r.raise_for_status()
        return r.json()["released"]

    def close(self) -> None:
        for c in self._clients:
            c.close()


@pytest.fixture
def gate_stack(binary: Path, tmp_path: Path) -> Iterator[Callable[..., GateStack]]:
    """Factory: gate_stack(config_toml, stub_slots=4, stub_latency="fixed:50ms") starts a stub
    and a gate configured by `config_toml` (with $listen, $upstream, $log placeholders)."""
    procs = ProcessGroup(tmp_path)
    stacks: list[GateStack] = []

    def start(config_toml: str, stub_slots: int = 4, stub_latency: str = "fixed:50ms",
              stub_output_tokens: int = 16) -> GateStack:
        # A port can be taken between picking and binding: retry with fresh ports.
        for attempt in range(3):
            stub_port, gate_port = free_port(), free_port()
            if stub_port == gate_port:
                continue
            stub_url = f"http://{HOST}:{stub_port}"
            stub, stub_out = procs.start(f"stub-{len(stacks)}-{attempt}", [
                str(binary), "stub", "--listen", f"{HOST}:{stub_port}",
                "--slots", str(stub_slots), "--latency", stub_latency,
                "--output-tokens", str(stub_output_tokens),
            ])
            try:
                wait_healthy(stub, stub_out, f"{stub_url}/health", "slackgate stub")
            except RuntimeError as e:
                procs.stop_one(stub)
                if attempt == 2 or not port_clash(e):
                    raise
                continue
            log_path = tmp_path / f"decisions-{len(stacks)}.jsonl"
            config_path = tmp_path / f"gate-{len(stacks)}.toml"
            config_path.write_text(string.Template(config_toml).substitute(
                listen=f"{HOST}:{gate_port}", upstream=stub_url, log=str(log_path)))
            gate_url = f"http://{HOST}:{gate_port}"
            gate, gate_out = procs.start(f"gate-{len(stacks)}-{attempt}", [
                str(binary), "serve", "--config", str(config_path),
            ])
            try:
                wait_healthy(gate, gate_out, f"{gate_url}/healthz", "slackgate serve")
            except RuntimeError as e:
                procs.stop_one(gate)
                procs.stop_one(stub)
                if attempt == 2 or not port_clash(e):
                    raise
                continue
            s = GateStack(gate_url, stub_url, log_path, config_path, procs)
            stacks.append(s)
            return s
        raise RuntimeError("could not start stub and gate on free ports")

    try:
        yield start
    finally:
        for s in stacks:
            try:
                s.release_stub()  # wake anything a failed test left held
            except Exception:
                pass
            s.close()
        procs.stop_all()
