"""The Prometheus registry and the periodic log line, fed as AsyncLLM's output handler does."""

import logging
import re

from jaxserve.ipc.messages import SchedulerStats
from jaxserve.metrics.log_line import LoggingStatLogger
from jaxserve.metrics.prometheus import PrometheusStatLogger
from jaxserve.metrics.stats import FinishedRequestStats, IterationStats

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


# ---------------------------------------------------------------------- vLLM 0.32's series
def samples(prom: PrometheusStatLogger) -> dict[tuple, float]:
    """{(sample name, its labels but model_name and engine, sorted): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    got = {}
    for family in text_string_to_metric_families(prom.exposition().decode()):
        for s in family.samples:
            labels = sorted(
                (k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")
            )
            got[(s.name, *labels)] = s.value
    return got


def test_vllms_newer_series_exist_at_zero_with_its_labels():
    """What vLLM 0.32's test_metrics.py expects on a server that has served nothing yet,
    admission rejections included (jaxserve never refuses a request at admission)."""
    got = samples(PrometheusStatLogger("m"))
    for key in [
        ("vllm:num_requests_waiting_by_reason", ("reason", "capacity")),
        ("vllm:num_requests_waiting_by_reason", ("reason", "deferred")),
        ("vllm:admission_rejections_total", ("reason", "max_num_queued_reqs")),
        ("vllm:admission_rejections_total", ("reason", "max_num_queued_tokens")),
        ("vllm:iteration_tokens_total_count",),
        ("vllm:request_params_n_count",),
        ("vllm:request_params_max_tokens_sum",),
        ("vllm:request_num_preemptions_count",),
    ]:
        assert got[key] == 0.0, key
    assert ("vllm:request_params_n_bucket", ("le", "20.0")) in got  # vLLM's buckets
    assert ("vllm:iteration_tokens_total_bucket", ("le", "16384.0")) in got
    assert ("vllm:request_num_preemptions_bucket", ("le", "3.0")) in got


def test_waiting_requests_by_reason_sum_to_the_waiting_ones():
    prom = PrometheusStatLogger("m")
    prom.record(SchedulerStats(num_waiting_reqs=5, num_deferred_reqs=2), IterationStats())
    got = samples(prom)
    assert got[("vllm:num_requests_waiting",)] == 5.0
    assert got[("vllm:num_requests_waiting_by_reason", ("reason", "capacity"))] == 3.0
    assert got[("vllm:num_requests_waiting_by_reason", ("reason", "deferred"))] == 2.0
    prom.engine_dead()
    assert samples(prom)[("vllm:num_requests_waiting_by_reason", ("reason", "deferred"))] == 0


def test_iteration_tokens_and_request_parameters():
    """One observation per engine step with outputs (the prompt tokens computed, not those
    found in a cache, plus the tokens generated); n, max_tokens and preemptions per finished
    request, a pooling request's parameters not (it has none)."""
    prom = PrometheusStatLogger("m")
    step = IterationStats(num_prompt_tokens=50, num_computed_prompt_tokens=34,
                          num_generation_tokens=3, engine_step=True)  # fmt: skip
    prom.record(None, step)
    prom.record(None, IterationStats(engine_step=True, num_generation_tokens=2))
    sampled = FinishedRequestStats("length", 1.0, 0.1, 50, 14, 7, n=2, max_tokens=7,
                                   num_preemptions=3)  # fmt: skip
    pooled = FinishedRequestStats("length", 1.0, 0.1, 50, 1, 1)
    prom.record(None, IterationStats(finished=[sampled, pooled]))  # an abort's: no step
    got = samples(prom)
    assert got[("vllm:iteration_tokens_total_sum",)] == 34 + 3 + 2
    assert got[("vllm:iteration_tokens_total_count",)] == 2
    assert got[("vllm:request_params_n_sum",)] == 2 and got[("vllm:request_params_n_count",)] == 1
    assert got[("vllm:request_params_max_tokens_sum",)] == 7
    assert got[("vllm:request_params_max_tokens_count",)] == 1
    assert got[("vllm:request_num_preemptions_sum",)] == 3
    assert got[("vllm:request_num_preemptions_count",)] == 2
    assert got[("vllm:request_num_preemptions_bucket", ("le", "1.0"))] == 1


def test_cache_config_info_labels_the_kv_cache_of_each_engine():
    from types import SimpleNamespace

    from jaxserve.config.engine import CacheConfig

    prom = PrometheusStatLogger("m", num_engines=2)
    config = SimpleNamespace(
        cache=CacheConfig(block_size=16), scheduler=SimpleNamespace(max_model_len=1024)
    )
    prom.log_cache_config(config, [100, 80])
    info = [k for k in samples(prom) if k[0] == "vllm:cache_config_info"]
    assert len(info) == 2
    first = dict(info[0][1:])
    assert first["block_size"] == "16" and first["enable_prefix_caching"] == "True"
    assert first["num_gpu_blocks"] == "100" and first["kv_cache_size_tokens"] == "1600"
    assert first["kv_cache_max_concurrency"] == "1.56"  # 1600 tokens / 1024
    assert dict(info[1][1:])["kv_cache_size_tokens"] == "1280"


def test_load_report_reads_the_gauges():
    """The ORCA named metrics: waiting summed over the engines, KV usage their mean."""
    prom = PrometheusStatLogger("m", num_engines=2)
    assert prom.load_report() == {"num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}
    prom.record(SchedulerStats(num_waiting_reqs=3, kv_cache_usage=0.5), IterationStats(), 0)
    prom.record(SchedulerStats(num_waiting_reqs=1, kv_cache_usage=0.25), IterationStats(), 1)
    assert prom.load_report() == {"num_requests_waiting": 4.0, "kv_cache_usage_perc": 0.375}
