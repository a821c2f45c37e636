"""Prometheus metrics of the reference engine, under SGLang 0.5.23's names, types and buckets
(sglang/srt/observability/metrics_collector.py), so one dashboard serves both engines.

Each engine process owns a private ``CollectorRegistry`` (tests run several engines in one
process). Names SGLang has no equivalent for are prefixed ``pdserve_``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from pd.util.pd_stages import ENGINE_STAGES

# Bucket lists copied as facts from SGLang's collector (same boundaries -> comparable quantiles).
TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400]
ITL_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
               0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000]
E2E_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400]
STAGE_BUCKETS = [0.001 * 1.62**i for i in range(30)]  # exponential_buckets(0.001, 1.62, 30)
TRANSFER_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
TRANSFER_MB_BUCKETS = (1, 5, 10, 50, 100, 500, 1000, 5000, 10000)
TRANSFER_GBS_BUCKETS = (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400)

# Stage label values of sglang:per_stage_req_latency_seconds (sglang/srt/observability/req_time_stats.py).
STAGES = tuple(s.label for s in ENGINE_STAGES)


def _bool(flag: bool) -> str:
    return "true" if flag else "false"


class EngineMetrics:
    """All metrics of one engine.

    Args:
        model_name: the served model name (label ``model_name``).
        mode: ``null``, ``prefill`` or ``decode`` (label ``engine_type``; SGLang uses
            ``unified`` for non-disaggregated servers).
    """

    def __init__(self, model_name: str, mode: str):
        self.registry = CollectorRegistry()
        # process_cpu_seconds_total and friends, as every Prometheus client exports them: the planner's profile reads
        # the CPU an engine spends per request outside its model thread (pd.planner.measure)
        ProcessCollector(registry=self.registry)
        engine_type = "unified" if mode == "null" else mode
        # SGLang's two label sets: request-level metrics come from its TokenizerMetricsCollector
        # (model_name, engine_type); scheduler metrics add the rank labels
        # (sglang/srt/observability/metrics_collector.py: tokenizer_metric_labels and
        # SchedulerMetricsCollector's labels). Same sets here, so a query written against one engine
        # works on the other.
        self.request_labels = {"model_name": model_name, "engine_type": engine_type}
        self.labels = {**self.request_labels, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        names = list(self.labels)
        req = list(self.request_labels)
        r = self.registry
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              req + ["is_streaming"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             req, buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("sglang:request_time_per_output_token_seconds",
                              "Per-request TPOT in seconds: "
                              "(finished_time - first_token_time) / (completion_tokens - 1).",
                              req + ["is_streaming"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                             req + ["is_streaming"], buckets=E2E_BUCKETS, registry=r)
        self.stage = Histogram("sglang:per_stage_req_latency_seconds", "The latency of each stage of requests.",
                               names + ["stage"], buckets=STAGE_BUCKETS, registry=r)
        self.running = Gauge("sglang:num_running_reqs", "The number of running requests.", names, registry=r)
        self.queued = Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", names, registry=r)
        self.prefill_bootstrap_queue = Gauge("sglang:num_prefill_bootstrap_queue_reqs",
                                             "Prefill requests waiting for their decode to register.", names,
                                             registry=r)
        self.decode_prealloc_queue = Gauge("sglang:num_decode_prealloc_queue_reqs",
                                           "Decode requests waiting for KV pages.", names, registry=r)
        self.decode_transfer_queue = Gauge("sglang:num_decode_transfer_queue_reqs",
                                           "Decode requests waiting for their KV to arrive.", names, registry=r)
        self.token_usage = Gauge("sglang:token_usage", "Fraction of the KV pool in use.", names, registry=r)
        self.num_used_tokens = Gauge("sglang:num_used_tokens", "KV tokens in use (held pages x page size).", names,
                                     registry=r)
        self.pages_held = Gauge("pdserve_kv_pages_held", "KV pages currently allocated from the pool.", names,
                                registry=r)
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate: cached over prompt tokens of "
                                    "the last prefill.", names, registry=r)
        self.pages_cached = Gauge("pdserve_kv_pages_cached", "KV pages the radix prefix cache keeps with no request "
                                  "using them (evictable; not counted in pdserve_kv_pages_held).", names, registry=r)
        self.pages_quarantined = Gauge("pdserve_kv_pages_quarantined",
                                       "KV pages (counted in pdserve_kv_pages_held) kept for a KV write abandoned at "
                                       "its deadline until the transfer engine reports it settled.", names, registry=r)
        self.transfer_ms = Histogram("sglang:kv_transfer_latency_ms", "Histogram of KV transfer latency in ms.",
                                     names, buckets=TRANSFER_MS_BUCKETS, registry=r)
        self.transfer_mb = Histogram("sglang:kv_transfer_total_mb", "Histogram of KV cache transfer size in MB.",
                                     names, buckets=TRANSFER_MB_BUCKETS, registry=r)
        self.transfer_speed = Histogram("sglang:kv_transfer_speed_gb_s", "Histogram of KV transfer speed in GB/s.",
                                        names, buckets=TRANSFER_GBS_BUCKETS, registry=r)
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes_total",
                                      "KV bytes written or received through the transfer engine.", names, registry=r)
        self.decode_prefix_cached = Counter("pdserve_decode_prefix_cached_tokens_total",
                                            "Prompt tokens a decode served from its own radix cache "
                                            "(--disaggregation-decode-enable-radix-cache): their KV was not "
                                            "transferred.", names, registry=r)
        self.transfer_failed = Counter("sglang:num_transfer_failed_reqs_total",
                                       "The number of transfer failed requests.", names, registry=r)
        self.bootstrap_failed = Counter("sglang:num_bootstrap_failed_reqs_total",
                                        "The number of bootstrap failed requests.", names, registry=r)
        self.prompt_tokens = Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                                     req + ["is_streaming"], registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens_total", "Number of generation tokens processed.",
                                         req + ["is_streaming"], registry=r)
        self.num_requests = Counter("sglang:num_requests_total", "The number of requests.", req + ["is_streaming"],
                                    registry=r)
        self.num_aborted = Counter("sglang:num_aborted_requests_total", "Number of requests aborted.", req, registry=r)
        self.connections_refused = Counter("pdserve_engine_client_connections_refused_total",
                                           "Client connections closed by a connection limit, by reason "
                                           "(pd.util.connection_guard).", ["reason"], registry=r)
        self.aborted = Counter("pdserve_engine_aborted_requests_total", "Requests aborted, by reason.",
                               names + ["reason"], registry=r)

        # Speculative decoding, as SGLang exports it: the two gauges over its last decode-log window of
        # verify steps (metrics_reporter.py; SGLang's --decode-log-interval, 40), the counter at request finish.
        self.spec_accept_length = Gauge("sglang:spec_accept_length",
                                        "Mean acceptance length of speculative decoding (accepted drafts + bonus "
                                        "token per forward).", names, registry=r)
        self.spec_accept_rate = Gauge("sglang:spec_accept_rate",
                                      "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).",
                                      names, registry=r)
        self.spec_verify_calls = Counter("sglang:spec_verify_calls", "Number of speculative decoding verification "
                                         "calls.", req, registry=r)
        self.spec_num_steps = Gauge("sglang:spec_num_steps", "Currently active speculative_num_steps.", names,
                                    registry=r)
        self.spec_num_draft_tokens = Gauge("sglang:spec_num_draft_tokens", "Currently active "
                                           "speculative_num_draft_tokens (decouples from steps under topk>1).",
                                           names, registry=r)
        # Ours alone (SGLang exports neither): the dashboards keep their panels in a "reference engine only" row.
        self.spec_step = Histogram("pdserve_spec_step_seconds", "Time of one speculative step's phases: draft (the "
                                   "chain), verify (one target forward over the window + acceptance), extend (the "
                                   "draft on the accepted tokens).", names + ["phase"], buckets=STAGE_BUCKETS,
                                   registry=r)
        self.draft_pages_held = Gauge("pdserve_draft_kv_pages_held", "Draft KV pages currently allocated from the "
                                      "draft's pool (speculative decoding).", names, registry=r)
        self._spec_window: list[tuple[int, int]] = []

        # Export every unlabeled-beyond-base series from the start (0), so queries see them before traffic.
        self.itl.labels(**self.request_labels)
        self.num_aborted.labels(**self.request_labels)
        for m in (self.running, self.queued, self.prefill_bootstrap_queue, self.decode_prealloc_queue,
                  self.decode_transfer_queue, self.token_usage, self.num_used_tokens, self.pages_held,
                  self.pages_quarantined, self.cache_hit_rate, self.pages_cached, self.transfer_ms,
                  self.transfer_mb, self.transfer_speed, self.transfer_bytes, self.decode_prefix_cached,
                  self.transfer_failed,
                  self.bootstrap_failed):
            m.labels(**self.labels)

    def observe_ttft(self, seconds: float, stream: bool) -> None:
        """Record one time to first token, in seconds."""
        self.ttft.labels(**self.request_labels, is_streaming=_bool(stream)).observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        """Record one inter-token latency, in seconds."""
        self.itl.labels(**self.request_labels).observe(seconds)

    def observe_finished(self, e2e: float, prompt_tokens: int, completion_tokens: int, stream: bool,
                         tpot: float | None, spec_verify_ct: int = 0) -> None:
        """One finished request, as SGLang's tokenizer records it on every engine type, the PD
        prefill included (so request counts and tokens summed over prefill + decode count each
        request twice; dashboards select ``engine_type=~"decode|unified"`` for them).

        Args:
            e2e: arrival to finish, seconds.
            tpot: (finish - first token) / (completion_tokens - 1) in seconds, or None (prefill
                side, aborted, or a single token), as SGLang leaves it unobserved then.
            spec_verify_ct: the request's speculative verify steps (counted when > 0, as SGLang does).
        """
        labels = dict(**self.request_labels, is_streaming=_bool(stream))
        self.e2e.labels(**labels).observe(e2e)
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.generation_tokens.labels(**labels).inc(completion_tokens)
        self.num_requests.labels(**labels).inc()
        if tpot is not None:
            self.tpot.labels(**labels).observe(tpot)
        if spec_verify_ct > 0:
            self.spec_verify_calls.labels(**self.request_labels).inc(spec_verify_ct)

    def observe_spec_step(self, accept_length: int, proposed: int, draft_s: float, verify_s: float,
                          extend_s: float, num_steps: int, window: int = 40) -> None:
        """One speculative verify step: ``accept_length`` tokens emitted-or-accepted (drafts + the bonus),
        ``proposed`` drafts (``num_draft_tokens - 1`` with topk 1), its phase times in seconds, and the depth it
        ran at (``num_steps``). The accept gauges are means over the last ``window`` steps (SGLang: accept
        length = accepted tokens / forwards, accept rate = accepted drafts / (forwards x (num_draft_tokens - 1)),
        over its decode-log interval); the depth gauges are the step's own, SGLang's "currently active" values."""
        self.spec_num_steps.labels(**self.labels).set(num_steps)
        self.spec_num_draft_tokens.labels(**self.labels).set(proposed + 1)
        self._spec_window.append((accept_length, proposed))
        del self._spec_window[:-window]
        tokens = sum(a for a, _ in self._spec_window)
        drafts = sum(p for _, p in self._spec_window)
        steps = len(self._spec_window)
        self.spec_accept_length.labels(**self.labels).set(tokens / steps)
        self.spec_accept_rate.labels(**self.labels).set((tokens - steps) / drafts if drafts else 0.0)
        for phase, sec in (("draft", draft_s), ("verify", verify_s), ("extend", extend_s)):
            self.spec_step.labels(**self.labels, phase=phase).observe(sec)

    def set_draft_pool(self, held_pages: int) -> None:
        """Publish the draft's KV pool occupancy (pages held)."""
        self.draft_pages_held.labels(**self.labels).set(held_pages)

    def observe_aborted(self, reason: str) -> None:
        """An aborted request; ``reason`` is ``user`` (/abort_request) or ``peer`` (the other PD side)."""
        self.aborted.labels(**self.labels, reason=reason).inc()
        self.num_aborted.labels(**self.request_labels).inc()

    def observe_stage(self, stage: str, seconds: float) -> None:
        """Record one PD stage duration in seconds; ``stage`` is one of STAGES (SGLang's label values)."""
        self.stage.labels(**self.labels, stage=stage).observe(seconds)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """Record one room's KV transfer (bytes, wall seconds)."""
        self.transfer_ms.labels(**self.labels).observe(seconds * 1e3)
        mb = nbytes / 2**20  # SGLang: total_mb = bytes / 2^20, speed = (mb / 1024) / seconds
        self.transfer_mb.labels(**self.labels).observe(mb)
        if seconds > 0:
            self.transfer_speed.labels(**self.labels).observe(mb / 1024 / seconds)
        self.transfer_bytes.labels(**self.labels).inc(nbytes)

    def set_pool(self, held_pages: int, num_pages: int, page_size: int, cached_pages: int = 0) -> None:
        """Publish KV pool occupancy: pages held by requests, token usage (fraction of pages) and tokens held, and
        the pages the prefix cache keeps unused (evictable: SGLang's token usage leaves them out too)."""
        self.pages_held.labels(**self.labels).set(held_pages)
        self.pages_cached.labels(**self.labels).set(cached_pages)
        self.token_usage.labels(**self.labels).set(held_pages / max(1, num_pages))
        self.num_used_tokens.labels(**self.labels).set(held_pages * page_size)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
