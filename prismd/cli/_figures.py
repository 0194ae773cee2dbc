"""Throughput and latency percentiles of a measured series (the bench's one figure)."""

from __future__ import annotations

from collections.abc import Sequence


def figures(samples_s: Sequence[float], elapsed_s: float) -> dict[str, float | int]:
    """count, per_s and the latency percentiles (ms) of one series."""
    if not samples_s:
        return {"count": 0, "per_s": 0.0}
    ordered = sorted(samples_s)

    def pct(p: float) -> float:
        index = min(len(ordered) - 1, max(0, round(p * (len(ordered) - 1))))
        return round(ordered[index] * 1000, 3)

    return {
        "count": len(ordered),
        "per_s": round(len(ordered) / elapsed_s, 1) if elapsed_s > 0 else 0.0,
        "p50_ms": pct(0.50),
        "p95_ms": pct(0.95),
        "p99_ms": pct(0.99),
        "max_ms": round(ordered[-1] * 1000, 3),
    }
