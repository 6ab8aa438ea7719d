"""The server's Prometheus metrics, in a registry of its own (one per app: tests and a library
caller may build several in one process), served by prometheus_client's exposition."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

# request latency buckets, seconds: from one short sentence alone to a long queue
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.queue_rows = Gauge("pardec_queue_rows", "texts waiting to join the running batch",
                                registry=registry)
        self.running_rows = Gauge("pardec_running_rows", "texts in the running batch",
                                  registry=registry)
        self.tokens_per_iteration = Gauge(
            "pardec_tokens_per_iteration",
            "target tokens a row gained per decoder iteration, over the last step",
            registry=registry)
        self.tokens_per_second = Gauge(
            "pardec_tokens_per_second", "target tokens decoded per second, over the last step",
            registry=registry)
        self.tokens = Counter("pardec_tokens", "target tokens decoded (EOS included)",
                              registry=registry)
        self.decoder_calls = Counter("pardec_decoder_calls", "batched decoder invocations",
                                     registry=registry)
        self.row_iterations = Counter("pardec_row_iterations",
                                      "per row, the decoder iterations it took part in",
                                      registry=registry)
        self.rows_decoded = Counter("pardec_rows_decoded", "texts decoded", registry=registry)
        self.rows_cancelled = Counter(
            "pardec_rows_cancelled",
            "texts that left before their end: client gone, deadline passed, decoding failed",
            registry=registry)
        self.requests = Counter("pardec_requests", "requests answered, by HTTP status",
                                ["status"], registry=registry)
        self.latency = Histogram("pardec_request_latency_seconds",
                                 "time from a request's arrival to its answer (200 only)",
                                 buckets=LATENCY_BUCKETS, registry=registry)

    def set_rows(self, waiting: int, running: int):
        self.queue_rows.set(waiting)
        self.running_rows.set(running)

    def observe_step(self, report):
        """One step of the running batch (running_batch.StepReport)."""
        self.tokens.inc(report.tokens)
        self.decoder_calls.inc(report.decoder_calls)
        self.row_iterations.inc(report.row_iterations)
        self.rows_decoded.inc(len(report.finished))
        if report.row_iterations:
            self.tokens_per_iteration.set(report.tokens / report.row_iterations)
        if report.seconds > 0:
            self.tokens_per_second.set(report.tokens / report.seconds)

    def answered(self, status: int, seconds: float = None):
        self.requests.labels(status=str(status)).inc()
        if status == 200 and seconds is not None:
            self.latency.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
