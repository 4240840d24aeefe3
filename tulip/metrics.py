"""Tulip's Prometheus metrics (served on --metrics-port): queue, batches, steps, requests, graphs; the
queue and its waits by priority class as well (`tulip_priority_*{priority="online"|"batch"}`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TIME_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)


class GraphCollector:
    """Exports the engine's GraphRunner stats at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        # the main runner's as tulip_graph_*, the online lane's (rose.engine.EngineConfig.online_lane_tokens, where
        # on) as tulip_graph_lane_*: its oversize counts online steps too big for the lane (run on the main stream)
        for prefix, runner, whose in (("tulip_graph", getattr(self.engine, "runner", None), ""),
                                      ("tulip_graph_lane", getattr(self.engine, "lane", None), " (the online lane)")):
            if runner is None:
                continue
            s = runner.stats
            for name, doc, value in (("keys", "graph keys seen", s.keys), ("eager", "eager warm-up runs", s.eager),
                                     ("captures", "graphs captured", s.captures), ("replays", "graph replays", s.replays),
                                     ("oversize", "steps too big for any graph", s.oversize),
                                     ("capture_ms", "total capture time, ms", s.capture_ms)):
                g = GaugeMetricFamily(f"{prefix}_{name}", doc + whose)
                g.add_metric([], value)
                yield g


class TulipMetrics:
    def __init__(self, engine=None):
        self.registry = r = CollectorRegistry()
        self.queue_tokens = Gauge("tulip_queue_tokens", "tokens waiting to be batched", registry=r)
        self.queue_requests = Gauge("tulip_queue_requests", "requests waiting to be batched", registry=r)
        self.batch_tokens = Histogram("tulip_batch_tokens", "tokens per engine step", buckets=TOKEN_BUCKETS, registry=r)
        self.batch_seqs = Histogram("tulip_batch_sequences", "sequences per engine step", buckets=SEQ_BUCKETS,
                                    registry=r)
        self.step_seconds = Histogram("tulip_step_seconds", "engine step, launch to result on the host",
                                      buckets=TIME_BUCKETS, registry=r)
        self.queue_seconds = Histogram("tulip_queue_seconds", "time a request waited before its first step",
                                       buckets=TIME_BUCKETS, registry=r)
        self.requests = Counter("tulip_requests", "requests by final gRPC status", ["status"], registry=r)
        # By priority class (tulip.scheduler ONLINE / BATCH), beside the totals above, whose names and
        # series stay as they were: the per-class wait (its _count: the class's requests that reached a
        # step) and the per-class queue, read from the scheduler at scrape time (no cost per request).
        per_class = Histogram("tulip_priority_queue_seconds", "time a request waited before its first step, "
                              "by priority class", ["priority"], buckets=TIME_BUCKETS, registry=r)
        self.class_queue_seconds = (per_class.labels("online"), per_class.labels("batch"))  # indexed by priority
        self._class_tokens = Gauge("tulip_priority_queue_tokens", "tokens waiting to be batched, by priority class",
                                   ["priority"], registry=r)
        self._class_requests = Gauge("tulip_priority_queue_requests", "requests waiting to be batched, by priority "
                                     "class", ["priority"], registry=r)
        if engine is not None:
            r.register(GraphCollector(engine))

    def by_class(self, scheduler) -> None:
        """Read the per-class queue gauges from `scheduler` (a tulip.scheduler.Scheduler) at scrape time."""
        s = scheduler
        self._class_tokens.labels("online").set_function(lambda: s.queued_tokens - s.batch_tokens)
        self._class_tokens.labels("batch").set_function(lambda: s.batch_tokens)
        self._class_requests.labels("online").set_function(lambda: len(s) - s.batch_live)
        self._class_requests.labels("batch").set_function(lambda: s.batch_live)

    def serve(self, port: int, host: str) -> None:
        start_http_server(port, addr=host, registry=self.registry)
