"""`/metrics`: Prometheus text from prometheus_client, in a registry of the server's own.

The speculative-decoding counters carry vLLM's names (spec_decode_num_drafts,
spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens,
spec_decode_num_accepted_tokens_per_pos with a position label) under the `ddtree:` prefix, as
vLLM's are under `vllm:`; a draft is a round that verified at least one draft node
(ddtree.stats.aggregate).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

P = "ddtree:"
SECONDS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
RATES = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.http = Counter(P + "http_requests", "HTTP requests answered, by route and status code",
                            ["route", "status"], registry=r)
        self.success = Counter(P + "request_success", "Generations finished, by finish reason (stop, length, "
                               "cancelled: the client left or the server stopped)", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of the generations", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.reused = Counter(P + "prompt_tokens_reused", "Prompt tokens taken from the state kept since the last "
                              "request (not prefilled again)", registry=r)
        self.prefilled = Counter(P + "prompt_tokens_prefilled", "Prompt tokens prefilled", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to the first token, from the start of "
                              "the generation (queue wait excluded)", buckets=SECONDS, registry=r)
        self.decode_rate = Histogram(P + "decode_tokens_per_second", "Decode rate of each generation",
                                     buckets=RATES, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Time a request waited for the engine",
                                    buckets=SECONDS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to the last token", buckets=SECONDS,
                             registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests in the queue", registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests the engine is busy with: generating, or settling the state after it (0 or 1)", registry=r)
        self.num_drafts = Counter(P + "spec_decode_num_drafts", "Drafted rounds", registry=r)
        self.num_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                               "Drafted rounds that accepted a token at this position", ["position"], registry=r)
        self.rounds = Counter(P + "decode_rounds", "Decode rounds (target forwards after the prefill)", registry=r)

    def generation(self, rec, counters: dict, reused: int, prefilled: int, finish: str, queue_s: float,
                   e2e_s: float) -> None:
        """A finished generation (rec: its GenerationRecord; counters: ddtree.stats.aggregate of it)."""
        self.success.labels(finish).inc()
        self.prompt_tokens.inc(rec.prompt_tokens)
        self.generation_tokens.inc(rec.new_tokens)
        self.reused.inc(reused)
        self.prefilled.inc(prefilled)
        self.ttft.observe(rec.ttft_s)
        if rec.decode_s > 0:
            self.decode_rate.observe(rec.decode_tok_s)
        self.queue_time.observe(queue_s)
        self.e2e.observe(e2e_s)
        self.rounds.inc(counters["rounds"])
        self.num_drafts.inc(counters["num_drafts"])
        self.num_draft_tokens.inc(counters["num_draft_tokens"])
        self.num_accepted.inc(counters["num_accepted_tokens"])
        for i, n in enumerate(counters["num_accepted_tokens_per_pos"]):
            if n:
                self.per_pos.labels(str(i)).inc(n)

    def text(self) -> bytes:
        return generate_latest(self.registry)
