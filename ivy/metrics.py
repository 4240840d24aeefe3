"""Ivy's Prometheus metrics (served on GET /metrics), every one labelled with the model served."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily


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

    def watch_tokenizers(self, models) -> None:
        """Per served model, from its native tokenizer where it has one (read at each scrape):
        ivy_tokenizer_fallback_texts (texts handed to `tokenizers`, which it could not decide exactly)
        and ivy_tokenizer_words (its word cache: hits, misses, resets)."""
        self.registry.register(_TokenizerCollector(models))


class _TokenizerCollector:
    def __init__(self, models):
        self.models = models

    def collect(self):
        fallbacks = CounterMetricFamily("ivy_tokenizer_fallback_texts", "texts the native tokenizer handed to "
                                        "tokenizers (it could not decide them exactly)", labels=["model"])
        words = CounterMetricFamily("ivy_tokenizer_words", "the native tokenizer's word cache: hits, misses, resets",
                                    labels=["model", "outcome"])
        for m in self.models.all:
            fast = m.tokenizer.fast
            if fast is None:
                continue
            stats = fast.native.stats()
            fallbacks.add_metric([m.name], stats["fallbacks"])
            for outcome in ("hits", "misses", "resets"):
                words.add_metric([m.name, outcome], stats[outcome])
        yield fallbacks
        yield words
