#!/usr/bin/env python3
"""Measures a llama-server's cost curve directly (no gate in between) and prints it as a
Markdown table: service time of one request alone and of four at once, for prompts of about
30, 500 and 1000 tokens and 16, 64 and 256 output tokens, plus the model's characters per
token on plain English text.

    export SLACKGATE_LLAMA_URL=$(scripts/real-server.sh start)
    python3 scripts/llama-cost-curve.py [--url URL] [--reps N]
    scripts/real-server.sh stop

Standard library only. Every prompt starts with a distinct tag, so no request can reuse
another's cached prompt in a slot (llama-server keeps each slot's last prompt): each one pays
its whole prefill, as a new user's request would. A random-weight model always generates
exactly `max_tokens`, so the output size is what was asked for; the script checks that
from `usage`. Times are wall-clock from sending the request to reading the whole response;
the per-token columns come from the server's own `timings` object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

# Plain English, written for this script: the text a chat client might send. Its characters
# per token is what a gate that counts characters has to learn for this model.
ENGLISH = (
    "The committee met on Thursday to review the proposal for a new bridge across the river. "
    "Several members raised concerns about the cost, which has nearly doubled since the first "
    "estimate was published two years ago. Others argued that the old crossing is no longer "
    "safe for heavy traffic and that any further delay would only make the work more "
    "expensive. After a long discussion, the chair asked the engineers to prepare a shorter "
    "plan with fewer lanes, and promised that residents would be able to comment on it before "
    "a final vote in the spring. Local shops near the old bridge said they hoped the "
    "construction would not block the main road during the busy summer months."
)

PROMPT_TOKENS = (30, 500, 1000)
OUTPUT_TOKENS = (16, 64, 256)
CONCURRENT = 4


def post(url: str, path: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def count_tokens(url: str, text: str) -> int:
    return len(post(url, "/tokenize", {"content": text})["tokens"])


def prompt_text(tag: str, tokens: int, chars_per_token: float, rng: random.Random) -> str:
    """English text of about `tokens` tokens (by the measured ratio), led by a unique tag."""
    words = ENGLISH.split()
    want = int(tokens * chars_per_token)
    out = [f"[{tag}]"]
    length = len(out[0])
    i = rng.randrange(len(words))
    while length < want:
        w = words[i % len(words)]
        out.append(w)
        length += len(w) + 1
        i += 1
    return " ".join(out)


def chat(url: str, text: str, max_tokens: int) -> dict:
    """One chat completion; returns wall ms, usage and the server's timings."""
    start = time.perf_counter()
    r = post(
        url,
        "/v1/chat/completions",
        {
            "model": "random-llama",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
        },
    )
    wall_ms = (time.perf_counter() - start) * 1000.0
    usage = r["usage"]
    if usage["completion_tokens"] != max_tokens:
        raise SystemExit(f"asked for {max_tokens} tokens, got {usage}")
    return {"wall_ms": wall_ms, "usage": usage, "timings": r.get("timings", {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=os.environ.get("SLACKGATE_LLAMA_URL"))
    ap.add_argument("--reps", type=int, default=2, help="alone runs per cell (median)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if not args.url:
        print("no --url and no SLACKGATE_LLAMA_URL: start scripts/real-server.sh", file=sys.stderr)
        return 2
    url = args.url.rstrip("/")
    rng = random.Random(args.seed)

    english_tokens = count_tokens(url, ENGLISH)
    cpt = len(ENGLISH) / english_tokens
    print(f"plain English: {len(ENGLISH)} chars, {english_tokens} tokens (/tokenize): "
          f"{cpt:.2f} chars/token")
    # The same text as a chat message: usage.prompt_tokens adds the chat template and BOS.
    probe = chat(url, ENGLISH, 1)
    overhead = probe["usage"]["prompt_tokens"] - english_tokens
    print(f"as a chat message: usage.prompt_tokens {probe['usage']['prompt_tokens']} "
          f"(the template adds {overhead} tokens); "
          f"{len(ENGLISH) / probe['usage']['prompt_tokens']:.2f} chars per prompt token")

    n = 0

    def tag() -> str:
        nonlocal n
        n += 1
        return f"r{args.seed}-{n}-{rng.randrange(10**6)}"

    print()
    print("| prompt tokens | max_tokens | alone ms | alone ms/out tok | alone prefill ms/tok "
          "| 4 at once: mean ms | max ms | ms/out tok | x alone |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    started = time.perf_counter()
    for p in PROMPT_TOKENS:
        for m in OUTPUT_TOKENS:
            alone = [chat(url, prompt_text(tag(), p - overhead, cpt, rng), m)
                     for _ in range(args.reps)]
            with ThreadPoolExecutor(CONCURRENT) as pool:
                texts = [prompt_text(tag(), p - overhead, cpt, rng) for _ in range(CONCURRENT)]
                together = list(pool.map(lambda t: chat(url, t, m), texts))
            a_ms = statistics.median(r["wall_ms"] for r in alone)
            a_dec = statistics.median(r["timings"].get("predicted_per_token_ms", 0) for r in alone)
            a_pre = statistics.median(r["timings"].get("prompt_per_token_ms", 0) for r in alone)
            t_ms = [r["wall_ms"] for r in together]
            t_dec = statistics.mean(r["timings"].get("predicted_per_token_ms", 0) for r in together)
            ptok = round(statistics.mean(r["usage"]["prompt_tokens"] for r in alone + together))
            print(f"| {ptok} | {m} | {a_ms:.0f} | {a_dec:.1f} | {a_pre:.2f} "
                  f"| {statistics.mean(t_ms):.0f} | {max(t_ms):.0f} | {t_dec:.1f} "
                  f"| {statistics.mean(t_ms) / a_ms:.2f} |", flush=True)
    print(f"\n{n} measured requests in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
