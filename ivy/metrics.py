"""Ivy's Prometheus metrics (served on GET /metrics), every one labelled with the model served."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        # route: the path template of the route (ivy.front.Front.route); model: the model routed to ("" none)
        self.requests = Counter("ivy_requests", "HTTP requests by route, status and model",
                                ["route", "status", "model"], registry=self.registry)
        self.latency = Histogram(
            "ivy_request_seconds", "embedding request latency", ["model"], registry=self.registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        )
        self.tokens = Counter("ivy_prompt_tokens", "tokens embedded or scored", ["model"], registry=self.registry)
