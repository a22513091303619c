#!/usr/bin/env python3
"""N subscribers of a gate's live stream (/live/stream), for scripts/bench-live.sh: a small
client (asyncio, standard library only), not N browsers. Each opens the stream with the
admin bearer token, reads every frame, and reconnects with Last-Event-ID when the gate ends
the stream (every 50 s). On SIGTERM it prints "subscribers N frames F bytes B errors E".

    live-subscribers.py HOST:PORT TOKEN N
"""
import asyncio
import re
import signal
import sys

stats = {"frames": 0, "bytes": 0, "errors": 0, "open": 0}
ID = re.compile(rb"\nid: (\d+)\n")


async def subscriber(host: str, port: int, token: str) -> None:
    last = 0
    while True:
        try:
            r, w = await asyncio.open_connection(host, port)
            head = (f"GET /live/stream HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {token}\r\n"
                    f"last-event-id: {last}\r\n\r\n")
            w.write(head.encode())
            await w.drain()
            status = await r.readline()
            if not status.startswith(b"HTTP/1.1 200"):
                stats["errors"] += 1
                w.close()
                await asyncio.sleep(1)
                continue
            stats["open"] += 1
            tail = b""
            while True:
                chunk = await r.read(65536)
                if not chunk:
                    break
                stats["bytes"] += len(chunk)
                stats["frames"] += chunk.count(b"event: frame")
                ids = ID.findall(tail[-64:] + chunk)
                if ids:
                    last = int(ids[-1])
                tail = chunk
            stats["open"] -= 1
            w.close()
        except OSError:
            stats["errors"] += 1
            await asyncio.sleep(1)


async def main() -> None:
    addr, token, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    host, port = addr.rsplit(":", 1)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    tasks = [asyncio.create_task(subscriber(host, int(port), token)) for _ in range(n)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    print(f"subscribers {n} frames {stats['frames']} bytes {stats['bytes']} errors {stats['errors']}",
          flush=True)


if __name__ == "__main__":
    asyncio.run(main())
