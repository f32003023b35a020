"""The dispatcher's own timings, observed in its process (`Dispatcher.tick`). Not registered anywhere by itself: each
app's registry exposes them through `service.collectors.InProcess`."""

from __future__ import annotations

from prometheus_client import Histogram

TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Observed by the dispatcher loop of this process (`Dispatcher.tick`); not registered anywhere by itself:
# each app's registry exposes it through `InProcess`.
DISPATCHER_TICK_SECONDS = Histogram(
    "shunter_dispatcher_tick_seconds", "Duration of one dispatcher tick in this process", buckets=TICK_BUCKETS,
    registry=None,
)  # fmt: skip
