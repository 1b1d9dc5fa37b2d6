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

        pool = "the paged KV pool (llama/core/worker/kv_cache.py)"
        self.kv = {k: Gauge(f"llama_{k}", f"{what} of {pool}", registry=r) for k, what in (
            ("kv_blocks_used", "blocks sequences reference"), ("kv_blocks_free", "blocks free or only cached"),
            ("kv_blocks_cached", "blocks kept for their prefix"), ("prefix_cache_prompt_tokens", "prompt tokens"),
            ("prefix_cache_hit_tokens", "prompt tokens read from the prefix cache"),
            ("kv_preemptions", "requests preempted"), ("kv_evictions", "cached blocks evicted"))}

        self.spec: dict = {}

    def kv_pool(self, pool) -> None:
        """The pool's own counts (totals since start; gauges, as the pool keeps them)."""
        values = {"kv_blocks_used": pool.used(), "kv_blocks_free": pool.available(), "kv_blocks_cached": pool.cached(),
                  "prefix_cache_prompt_tokens": pool.stats["prompt_tokens"],
                  "prefix_cache_hit_tokens": pool.stats["cached_tokens"],
                  "kv_preemptions": pool.stats["preemptions"], "kv_evictions": pool.stats["evictions"]}
        for k, v in values.items():
            self.kv[k].set(v)

    def speculation(self, stats: dict) -> None:
        """Speculative decoding's counts from the engine's stats (totals since start; absent when it is off)."""
        for k, what in (("verify_steps", "decode steps that verified drafts"), ("drafted_tokens", "tokens drafted"),
                        ("accepted_tokens", "drafted tokens accepted")):
            if k in stats:
                if k not in self.spec:
                    self.spec[k] = Gauge(f"llama_speculative_{k}", f"speculative decoding: {what}",
                                         registry=self.registry)
                self.spec[k].set(stats[k])

    def render(self) -> bytes:
        return generate_latest(self.registry)
