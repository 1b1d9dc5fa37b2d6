"""Prometheus metrics of one server (its own registry, so several apps in one process never collide)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.running = Gauge("llama_requests_running", "sequences holding a KV-cache slot", registry=r)
        self.waiting = Gauge("llama_requests_waiting", "sequences queued for a slot", registry=r)
        self.requests = Counter("llama_requests", "HTTP generation requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("llama_sequences_finished", "sequences finished, by finish reason", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("llama_prompt_tokens", "prompt tokens of finished sequences", registry=r)
        self.generated_tokens = Counter("llama_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("llama_time_to_first_token_seconds", "from arrival to the first text delta",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tpot = Histogram("llama_time_per_output_token_seconds", "mean time between tokens of a sequence",
                              buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
