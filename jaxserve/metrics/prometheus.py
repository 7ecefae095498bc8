"""The Prometheus registry of a model's engines (served by /metrics), with vLLM's names, labels
and buckets; across API-server processes through prometheus-client's multiprocess files."""

from __future__ import annotations

import dataclasses
import glob
import os

import prometheus_client as prom

from jaxserve import envs
from jaxserve.ipc.messages import KVConnectorStats, SchedulerStats, SpecDecodingStats
from jaxserve.metrics.stats import FinishedRequestStats, IterationStats

# vLLM's buckets (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
# vLLM's 1-2-5 buckets for token counts
TOKEN_BUCKETS = [m * 10**e for e in range(7) for m in (1, 2, 5)]
ITERATION_TOKENS_BUCKETS = [1, *(2**e for e in range(3, 15))]  # 1, 8, 16, ..., 16384
REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
FINISH_REASONS = ("stop", "length", "abort", "error")
# Why a request waits: no room in the batch yet, or held back by something else (vLLM's;
# SchedulerStats.num_deferred_reqs counts the second)
WAITING_REASONS = ("capacity", "deferred")
# vLLM's reasons for refusing a request at admission (--max-num-queued-reqs / -tokens).
# jaxserve bounds its queue by memory only and never refuses one: the series stay at 0,
# exported with vLLM's labels for the dashboards and alerts that read them.
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


def multiprocess_dir() -> str | None:
    """prometheus-client's multiprocess directory, when API servers share their metrics."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


PREFIX = "vllm:"  # vLLM's metric names
LEGACY_PREFIX = "jaxserve:"  # this project's before; exported too with the env opt-in


class PrometheusStatLogger:
    """The metrics of a model's engines, in their own registry (served by /metrics)."""

    def __init__(self, model_name: str, num_engines: int = 1):
        self.registry = prom.CollectorRegistry()
        labels = ["model_name", "engine"]

        def metric(cls, name, doc, **kw):
            if cls is prom.Gauge and multiprocess_dir():
                kw["multiprocess_mode"] = "mostrecent"
            return cls(
                f"{PREFIX}{name}", doc, labels + kw.pop("extra", []), registry=self.registry, **kw
            )

        g, c, h = prom.Gauge, prom.Counter, prom.Histogram
        self.running = metric(g, "num_requests_running", "Requests running on the device.")
        self.waiting = metric(g, "num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = metric(g, "kv_cache_usage_perc", "KV-cache usage, 1 = 100 percent.")
        self.prompt_tokens = metric(c, "prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = metric(c, "generation_tokens", "Generation tokens produced.")
        self.success = metric(
            c, "request_success", "Finished requests by finish reason.", extra=["finished_reason"]
        )
        self.prefix_queries = metric(c, "prefix_cache_queries", "Prefix-cache tokens queried.")
        self.prefix_hits = metric(c, "prefix_cache_hits", "Prefix-cache tokens hit.")
        self.preemptions = metric(c, "num_preemptions", "Requests preempted.")
        # A KV connector's tier (distributed/kv_transfer), labelled by the connector's name.
        conn = ["connector"]
        self.external_queries = metric(
            c, "external_prefix_cache_queries", "Tokens looked up in a KV connector.", extra=conn
        )
        self.external_hits = metric(
            c, "external_prefix_cache_hits", "Tokens a KV connector had.", extra=conn
        )
        self.kv_transfer_blocks = metric(
            c,
            "kv_transfer_blocks",
            "KV blocks loaded into / saved from the device cache.",
            extra=[*conn, "direction"],
        )
        self.kv_transfer_bytes = metric(
            c,
            "kv_transfer_bytes",
            "KV bytes loaded into / saved from the device cache.",
            extra=[*conn, "direction"],
        )
        self.kv_failed_loads = metric(
            c, "kv_transfer_failed_loads", "Requests whose KV did not arrive.", extra=conn
        )
        # Speculative decoding (labelled once an engine with a speculative config reports).
        self.spec_drafts = metric(c, "spec_decode_num_drafts", "Drafts scored (request-steps).")
        self.spec_draft_tokens = metric(c, "spec_decode_num_draft_tokens", "Draft tokens scored.")
        self.spec_accepted = metric(c, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = metric(
            c,
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted per position.",
            extra=["position"],
        )
        self.ttft = metric(
            h, "time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS
        )
        self.itl = metric(
            h, "inter_token_latency_seconds", "Time between outputs.", buckets=ITL_BUCKETS
        )
        self.e2e = metric(
            h, "e2e_request_latency_seconds", "Arrival to finish.", buckets=LATENCY_BUCKETS
        )
        per_request = [  # vLLM's per-request histograms (its Grafana dashboard's panels)
            ("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS),
            ("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS),
            ("request_max_num_generation_tokens", "Longest child's tokens.", TOKEN_BUCKETS),
            ("request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS),
            ("request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS),
            ("request_inference_time_seconds", "First scheduled to last.", LATENCY_BUCKETS),
            ("request_time_per_output_token_seconds", "Decode time per token.", ITL_BUCKETS),
            ("request_params_n", "The n request parameter.", REQUEST_PARAMS_N_BUCKETS),
            ("request_params_max_tokens", "The max_tokens request parameter.", TOKEN_BUCKETS),
            ("request_num_preemptions", "Times a request was preempted.", PREEMPTIONS_BUCKETS),
        ]
        self.per_request = {name: metric(h, name, doc, buckets=b) for name, doc, b in per_request}
        # vLLM's deprecated names its example dashboard still reads: the same values
        self.tpot_old = metric(
            h,
            "time_per_output_token_seconds",
            "Deprecated: inter_token_latency.",
            buckets=ITL_BUCKETS,
        )
        self.gpu_cache_old = metric(g, "gpu_cache_usage_perc", "Deprecated: kv_cache_usage_perc.")
        self.queue = metric(
            h, "request_queue_time_seconds", "Arrival to first scheduled.", buckets=LATENCY_BUCKETS
        )
        # vLLM's lora_requests_info (--enable-lora), with vLLM's labels only: the adapters
        # running and waiting (comma-joined names) and max_loras; the value is when it was set.
        lora_labels = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
        self.lora_info = prom.Gauge(
            f"{PREFIX}lora_requests_info",
            "Running stats on LoRA requests.",
            lora_labels,
            registry=self.registry,
            **({"multiprocess_mode": "mostrecent"} if multiprocess_dir() else {}),
        )
        self.waiting_by_reason = metric(
            g,
            "num_requests_waiting_by_reason",
            "Waiting requests by reason: 'capacity' "
            "(no room in the batch yet) or 'deferred' (held back by something else).",
            extra=["reason"],
        )
        self.admission_rejections = prom.Counter(
            f"{PREFIX}admission_rejections",
            "Requests refused at admission by a queue limit.",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self.iteration_tokens = metric(
            h,
            "iteration_tokens_total",
            "Tokens per engine step: prompts computed, generated.",
            buckets=ITERATION_TOKENS_BUCKETS,
        )
        self.cache_info: prom.Gauge | None = None  # log_cache_config
        self.model_name = model_name
        self.num_engines = num_engines
        exported = (
            self.running,
            self.waiting,
            self.kv_usage,
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue,
            self.tpot_old,
            self.gpu_cache_old,
            *self.per_request.values(),
            self.iteration_tokens,
        )
        for engine in map(str, range(num_engines)):  # exported as 0 from the start
            for m in exported:
                m.labels(model_name, engine)
            for reason in FINISH_REASONS:
                self.success.labels(model_name, engine, reason)
            for reason in WAITING_REASONS:
                self.waiting_by_reason.labels(model_name, engine, reason)
        for reason in ADMISSION_REASONS:  # never counted: see ADMISSION_REASONS
            self.admission_rejections.labels(model_name, reason)

    def log_cache_config(self, config, num_blocks: list[int] | None) -> None:
        """vLLM's cache_config_info: a gauge at 1 per engine whose labels are the KV cache's
        configuration (config: the EngineConfig; num_blocks: each engine's KV-cache blocks,
        None when the core did not say), with its size in tokens and the concurrency it
        allows at max_model_len, as the start-up log has them."""
        cache = config.cache
        labels = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}
        self.cache_info = prom.Gauge(
            f"{PREFIX}cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [
                *labels,
                "num_gpu_blocks",
                "kv_cache_size_tokens",
                "kv_cache_max_concurrency",
                "engine",
            ],
            registry=self.registry,
            **({"multiprocess_mode": "mostrecent"} if multiprocess_dir() else {}),
        )
        max_model_len = config.scheduler.max_model_len
        for engine in range(self.num_engines):
            blocks = num_blocks[engine] if num_blocks else None
            tokens = None if blocks is None else blocks * cache.block_size
            concurrency = None if tokens is None else round(tokens / max_model_len, 2)
            values = [*labels.values(), blocks, tokens, concurrency, engine]
            self.cache_info.labels(*map(str, values)).set(1)

    def record(self, sched: SchedulerStats | None, it: IterationStats, engine: int = 0) -> None:
        labels = (self.model_name, str(engine))
        if sched is not None:
            self.running.labels(*labels).set(sched.num_running_reqs)
            self.waiting.labels(*labels).set(sched.num_waiting_reqs)
            by_reason, deferred = self.waiting_by_reason, sched.num_deferred_reqs
            by_reason.labels(*labels, "capacity").set(sched.num_waiting_reqs - deferred)
            by_reason.labels(*labels, "deferred").set(deferred)
            self.kv_usage.labels(*labels).set(sched.kv_cache_usage)
            self.gpu_cache_old.labels(*labels).set(sched.kv_cache_usage)
            self.prefix_queries.labels(*labels).inc(sched.prefix_cache_queries)
            self.prefix_hits.labels(*labels).inc(sched.prefix_cache_hits)
            self.preemptions.labels(*labels).inc(sched.num_preemptions)
            if sched.spec_decoding is not None:
                self._record_spec(sched.spec_decoding, labels)
            if sched.kv_connector is not None:
                self._record_kv_connector(sched.kv_connector, labels)
            if sched.running_lora_adapters is not None:
                waiting = ",".join(sched.waiting_lora_adapters or {})
                running = ",".join(sched.running_lora_adapters)
                self.lora_info.labels(str(sched.max_loras), waiting, running).set_to_current_time()
        self.prompt_tokens.labels(*labels).inc(it.num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(it.num_generation_tokens)
        if it.engine_step:  # (vLLM's: one observation per step that had outputs)
            self.iteration_tokens.labels(*labels).observe(
                it.num_computed_prompt_tokens + it.num_generation_tokens
            )
        for t in it.time_to_first_tokens:
            self.ttft.labels(*labels).observe(t)
        if it.inter_token_latencies:  # (one per running request and step: children looked up once)
            itl, tpot_old = self.itl.labels(*labels), self.tpot_old.labels(*labels)
            for t in it.inter_token_latencies:
                itl.observe(t)
                tpot_old.observe(t)
        for f in it.finished:
            self.success.labels(*labels, f.finish_reason).inc()
            self.e2e.labels(*labels).observe(f.e2e_latency)
            if f.queue_time is not None:
                self.queue.labels(*labels).observe(f.queue_time)
            self._record_finished(f, labels)

    def _record_finished(self, f: FinishedRequestStats, labels: tuple) -> None:
        values = {
            "request_prompt_tokens": f.num_prompt_tokens,
            "request_generation_tokens": f.num_generation_tokens,
            "request_max_num_generation_tokens": f.max_generation_tokens,
            "request_prefill_time_seconds": f.prefill_time,
            "request_decode_time_seconds": f.decode_time,
            "request_inference_time_seconds": f.inference_time,
            "request_time_per_output_token_seconds": (
                f.decode_time / (f.max_generation_tokens - 1)
                if f.decode_time is not None and f.max_generation_tokens > 1
                else None
            ),
            "request_params_n": f.n,
            "request_params_max_tokens": f.max_tokens,
            "request_num_preemptions": f.num_preemptions,
        }
        for name, value in values.items():
            if value is not None:
                self.per_request[name].labels(*labels).observe(value)

    def _record_kv_connector(self, kv: KVConnectorStats, labels: tuple) -> None:
        labels = (*labels, kv.connector)
        self.external_queries.labels(*labels).inc(kv.queries)
        self.external_hits.labels(*labels).inc(kv.hits)
        self.kv_failed_loads.labels(*labels).inc(kv.failed_loads)
        for direction, blocks in (("load", kv.loaded_blocks), ("save", kv.saved_blocks)):
            self.kv_transfer_blocks.labels(*labels, direction).inc(blocks)
            self.kv_transfer_bytes.labels(*labels, direction).inc(blocks * kv.block_bytes)

    def _record_spec(self, spec: SpecDecodingStats, labels: tuple[str, str]) -> None:
        self.spec_drafts.labels(*labels).inc(spec.num_drafts)
        self.spec_draft_tokens.labels(*labels).inc(spec.num_draft_tokens)
        self.spec_accepted.labels(*labels).inc(spec.num_accepted_tokens)
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(*labels, str(pos)).inc(n)

    def engine_dead(self) -> None:
        """The gauges read 0 once the engine core is gone: nothing runs or waits any more."""
        for engine in range(self.num_engines):
            for gauge in (self.running, self.waiting, self.kv_usage):
                gauge.labels(self.model_name, str(engine)).set(0)
            for reason in WAITING_REASONS:
                self.waiting_by_reason.labels(self.model_name, str(engine), reason).set(0)

    def load_report(self) -> dict[str, float]:
        """vLLM's ORCA named metrics, from the gauges: the requests waiting (summed over the
        engines) and the KV-cache usage (their mean: the engines' caches are the same size)."""
        if multiprocess_dir():  # the engines' stats may reach another API server: every one's
            from prometheus_client import multiprocess

            gauges = glob.glob(os.path.join(multiprocess_dir(), "gauge_mostrecent_*.db"))
            families = multiprocess.MultiProcessCollector.merge(gauges, accumulate=False)
        else:  # (these two alone: reading the whole registry takes milliseconds)
            families = [*self.waiting.collect(), *self.kv_usage.collect()]
        values = {f.name: [s.value for s in f.samples] for f in families}
        waiting = values.get(f"{PREFIX}num_requests_waiting") or [0.0]
        usage = values.get(f"{PREFIX}kv_cache_usage_perc") or [0.0]
        return {
            "num_requests_waiting": float(sum(waiting)),
            "kv_cache_usage_perc": float(sum(usage) / len(usage)),
        }

    def exposition(self) -> bytes:
        registry = self.registry
        if multiprocess_dir():  # every API server's values
            from prometheus_client import multiprocess

            registry = prom.CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        text = prom.generate_latest(registry)
        if envs.JAXSERVE_METRICS_LEGACY_PREFIX:  # the old names too
            legacy = text.replace(PREFIX.encode(), LEGACY_PREFIX.encode())
            text += b"".join(
                line + b"\n" for line in legacy.splitlines() if LEGACY_PREFIX.encode() in line
            )
        return text
