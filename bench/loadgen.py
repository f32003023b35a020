"""The load generator of the submission benchmark: C concurrent asyncio clients (httpx), a fixed request count."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from bench.common import median, pct


async def _run(url: str, body: dict[str, Any], total: int, concurrency: int) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    remaining = total
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30.0) as client:

        async def worker() -> None:
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                r = await client.post(url, json=body)
                latencies.append(time.perf_counter() - t0)
                if r.status_code >= 300:
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {
        "requests": total,
        "concurrency": concurrency,
        "errors": errors,
        "seconds": elapsed,
        "per_s": total / elapsed,
        "p50_ms": median(latencies) * 1e3,
        "p99_ms": pct(latencies, 99) * 1e3,
    }


def post_load(url: str, body: dict[str, Any], *, total: int, concurrency: int, warmup: int = 30) -> dict[str, Any]:
    asyncio.run(_run(url, body, warmup, min(concurrency, warmup)))
    return asyncio.run(_run(url, body, total, concurrency))
