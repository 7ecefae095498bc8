"""Serving metrics: Prometheus (prometheus-client, `prometheus.py`) and vLLM's periodic log line
(`log_line.py`), fed the records of `stats.py`.

AsyncLLM's output handler records, after each batch of core outputs, the scheduler's state
(`SchedulerStats`, from the core) and what the frontend saw (`IterationStats`: tokens, TTFT,
ITL, finished requests, filled by the OutputProcessor), with the index of the engine that sent
the batch. Names are vLLM's (`vllm:...`), with its model_name and engine labels, so dashboards
and alerts written for vLLM read them; JAXSERVE_METRICS_LEGACY_PREFIX=1 also exports each under
the `jaxserve:` prefix this project used before (an opt-in alias: every series twice).

With several API-server processes (`--api-server-count`) every process writes its values into
prometheus-client's multiprocess files (`PROMETHEUS_MULTIPROC_DIR`, set by the launcher before
prometheus_client is imported) and /metrics on any of them reads all: counters and histograms
summed over the processes, the gauges (one engine's queue and KV cache) as last written.
"""
