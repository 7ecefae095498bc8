"""The Prometheus registry and the periodic log line, fed as AsyncLLM's output handler does."""

import logging
import re

from jaxserve.ipc.messages import SchedulerStats
from jaxserve.metrics import (
    FinishedRequestStats,
    IterationStats,
    LoggingStatLogger,
    PrometheusStatLogger,
)

SCHED = SchedulerStats(
    num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25, prefix_cache_queries=100,
    prefix_cache_hits=40, num_preemptions=1,
)  # fmt: skip
ITER = IterationStats(
    num_prompt_tokens=50, num_generation_tokens=7, time_to_first_tokens=[0.2],
    inter_token_latencies=[0.03, 0.04],
    finished=[FinishedRequestStats("length", 1.5, 0.1, 50, 7)],
)  # fmt: skip


def test_prometheus_names_values_and_labels():
    prom = PrometheusStatLogger("m")
    prom.record(SCHED, ITER)
    prom.record(None, IterationStats(num_generation_tokens=3))
    text = prom.exposition().decode()
    for line in [
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 50.0',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 10.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0',
        'vllm:num_preemptions_total{engine="0",model_name="m"} 1.0',
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0',
        'vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 0.0',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 1.0',
        'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 2.0',
        'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 1.5',
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.1',
    ]:
        assert line in text, line
    assert "jaxserve:" not in text  # the old prefix only on request


def test_the_old_prefix_is_an_opt_in_alias(monkeypatch):
    prom = PrometheusStatLogger("m")
    prom.record(SCHED, ITER)
    monkeypatch.setenv("JAXSERVE_METRICS_LEGACY_PREFIX", "1")
    text = prom.exposition().decode()
    for name in ("num_requests_running", "prompt_tokens_total"):
        new = re.search(rf"^vllm:{name}{{[^}}]*}} (\S+)$", text, re.M)
        old = re.search(rf"^jaxserve:{name}{{[^}}]*}} (\S+)$", text, re.M)
        assert new and old and new[1] == old[1], name
    assert "# TYPE jaxserve:prompt_tokens_total counter" in text


def test_log_line_reports_throughput_state_and_hit_rate(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.metrics")
    log = LoggingStatLogger()
    log.last_log -= 10.0  # as if the last line was 10 s ago
    log.record(SCHED, ITER)
    line = log.log()
    assert "Avg prompt throughput: 5.0 tokens/s" in line
    assert "Avg generation throughput: 0.7 tokens/s" in line
    assert "Running: 3 reqs, Waiting: 2 reqs" in line
    assert "KV cache usage: 25.0%" in line and "Prefix cache hit rate: 40.0%" in line
    assert line in caplog.text
    assert "Avg prompt throughput: 0.0" in log.log()  # counts restart after each line


def test_a_dead_engine_zeroes_the_gauges_and_stops_the_server():
    """api_server.watch_engine: once the engine reports errored, running / waiting / KV read
    0 (they would otherwise keep the last step's values) and the server is told to stop."""
    import asyncio
    from types import SimpleNamespace as NS

    from jaxserve.entrypoints.openai.api_server import watch_engine

    prom = PrometheusStatLogger("m")
    prom.record(SCHED, ITER)
    engine = NS(errored=False, engine_core=NS(dead="the core died"))
    stopped = []
    state = NS(serving=NS(engine=engine), prometheus=prom, engine_died=False,
               on_engine_death=lambda: stopped.append(True))  # fmt: skip

    async def run() -> None:
        task = asyncio.create_task(watch_engine(NS(state=state), interval=0.01))
        await asyncio.sleep(0.05)
        assert not stopped and not task.done()
        engine.errored = True
        await asyncio.wait_for(task, 1)

    asyncio.run(run())
    assert stopped == [True] and state.engine_died
    text = prom.exposition().decode()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f'vllm:{name}{{engine="0",model_name="m"}} 0.0' in text, name


def test_speculative_decoding_counters_and_log_line(caplog):
    from jaxserve.ipc.messages import SpecDecodingStats

    spec = SpecDecodingStats()
    spec.observe(3, 2)
    spec.observe(3, 0)
    spec.observe(2, 2)
    sched = SchedulerStats(spec_decoding=spec)
    prom = PrometheusStatLogger("m")
    prom.record(sched, IterationStats())
    per_pos = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",'
    text = prom.exposition().decode()
    for line in [
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 8.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 4.0',
        per_pos + 'position="0"} 2.0',
        per_pos + 'position="1"} 2.0',
        per_pos + 'position="2"} 0.0',
    ]:
        assert line in text, line
    caplog.set_level(logging.INFO, logger="jaxserve.metrics")
    log = LoggingStatLogger()
    log.last_log -= 2.0
    log.record(sched, IterationStats())
    line = log.log().splitlines()[1]
    assert line.startswith("SpecDecoding metrics: Mean acceptance length: 2.33, ")
    assert "Accepted: 4 tokens, Drafted: 8 tokens" in line
    assert "Per-position acceptance rate: 0.667, 0.667, 0.000" in line
    assert line.endswith("Avg Draft acceptance rate: 50.0%")
    assert len(LoggingStatLogger().log().splitlines()) == 1  # no speculation: no second line


# The queries of vLLM's example Grafana dashboard (examples/online_serving/prometheus_grafana),
# $model_name set as Grafana's variable query would set it.
GRAFANA = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',  # noqa: E501
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval]) / rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',  # noqa: E501
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',  # noqa: E501
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',  # noqa: E501
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',  # noqa: E501
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',  # noqa: E501
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',  # noqa: E501
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
]  # fmt: skip


def test_vllms_grafana_dashboard_queries_return_series():
    from prometheus_client.parser import text_string_to_metric_families

    prom = PrometheusStatLogger("m")
    finished = FinishedRequestStats("stop", 1.5, 0.1, 50, 7, 7, 0.2, 1.2, 1.4)
    prom.record(SCHED, IterationStats(num_prompt_tokens=50, num_generation_tokens=7,
                                      time_to_first_tokens=[0.3], inter_token_latencies=[0.2],
                                      finished=[finished]))  # fmt: skip
    samples = [s for f in text_string_to_metric_families(prom.exposition().decode())
               for s in f.samples]  # fmt: skip
    # Grafana's variable: label_values({__name__=~"vllm:.*"}, model_name)
    models = {s.labels["model_name"] for s in samples if s.name.startswith("vllm:")}
    assert models == {"m"}
    for query in GRAFANA:
        for name, matchers in re.findall(r"(vllm:\w+)\{([^}]*)\}", query):
            want = dict(re.findall(r'(\w+)="([^"]*)"', matchers.replace("$model_name", "m")))
            series = [s for s in samples if s.name == name
                      and all(s.labels.get(k) == v for k, v in want.items())]  # fmt: skip
            assert series, f"{name} has no series for {query}"
            if name.endswith(("_sum", "_count")) and "request_" in name:
                assert any(s.value > 0 for s in series), name  # observed, not only declared
