"""Online serving benchmark, vLLM `bench serve` style: an OpenAI streaming client against a
running server (`jaxserve serve`, or any OpenAI-compatible one).

--num-prompts requests of random token ids (the completions API takes token-id prompts, so no
tokenizer is needed on either side), lengths drawn uniformly from
[len * (1 - --random-range-ratio), len * (1 + --random-range-ratio)] around
--random-input-len / --random-output-len, max_tokens = the output length, ignore_eos with
--ignore-eos. Arrivals are a Poisson process at --request-rate requests/s (gamma intervals
with --burstiness != 1; inf: all at once), at most --max-concurrency in flight.

Per request, from the SSE stream (stream_options.include_usage): TTFT = time to the first
chunk with a choice, ITL = the gaps between later chunks, TPOT = (latency - TTFT) / (output
tokens - 1), output tokens from the usage chunk. Prints vLLM's result block (successful and
failed requests, duration, request / output / total token throughput, mean / median / P99
TTFT, TPOT, ITL in ms) and, when the server exports it (`jaxserve:` or `vllm:` Prometheus
names on /metrics), the KV-cache usage once the run has drained (0 when every block came
back). --save-result writes it all as JSON. The prompts depend only on --seed: give each run
against one server its own seed, or the repeated prompts hit the server's prefix cache.

    .venv/bin/jaxserve serve &
    .venv/bin/python benchmarks/bench_serve.py --request-rate 2 --num-prompts 50 \\
        --random-input-len 128 --random-output-len 64 --random-range-ratio 0.5 --ignore-eos

Needs httpx (the `test` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from tqdm.auto import tqdm

from jaxserve.benchmarks.common import benchmark_parser


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0  # generated tokens (the usage chunk's completion_tokens)
    success: bool = False
    error: str = ""
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)


def sample_requests(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request, vLLM's random dataset without a tokenizer."""
    rng = np.random.default_rng(args.seed)
    r = args.random_range_ratio

    def lengths(mean: int) -> np.ndarray:
        low, high = max(1, int(mean * (1 - r))), max(1, int(mean * (1 + r)))
        return rng.integers(low, high + 1, args.num_prompts)

    input_lens, output_lens = lengths(args.random_input_len), lengths(args.random_output_len)
    low = 100 if args.random_vocab_size > 1000 else 0
    return [
        (rng.integers(low, args.random_vocab_size, n).tolist(), int(m))
        for n, m in zip(input_lens, output_lens, strict=True)
    ]


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    ignore_eos: bool,
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    result = RequestResult(len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
        result.success = result.ttft > 0.0
        if not result.success:
            result.error = "the stream ended without a token"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator):
    """Yield 0..n-1 at a Poisson (gamma when burstiness != 1) process of `rate` per second."""
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            theta = 1.0 / (rate * burstiness)  # mean interval 1 / rate
            await asyncio.sleep(rng.gamma(burstiness, theta))


async def benchmark(args: argparse.Namespace, model: str, requests) -> tuple[list, float]:
    url = f"{args.base_url}{args.endpoint}"
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests) or 1)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        print("Starting initial single prompt test run...")
        prompt, max_tokens = requests[0]
        test = await send_request(client, url, model, prompt, max_tokens, args.ignore_eos)
        if not test.success:
            raise SystemExit(f"Initial test run failed: {test.error}")
        print("Initial test run completed. Starting main benchmark run...")

        semaphore = asyncio.Semaphore(args.max_concurrency or len(requests))
        bar = tqdm(total=len(requests), disable=args.disable_tqdm)

        async def one(i: int) -> RequestResult:
            async with semaphore:
                out = await send_request(client, url, model, *requests[i], args.ignore_eos)
            bar.update(1)
            return out

        rng = np.random.default_rng(args.seed + 1)
        start = time.perf_counter()
        tasks = []
        async for i in arrivals(len(requests), args.request_rate, args.burstiness, rng):
            tasks.append(asyncio.create_task(one(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return results, duration


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [t for r in ok for t in r.itl]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    metrics = dict(
        duration=duration,
        completed=len(ok),
        failed=len(results) - len(ok),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(ok) / duration,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
    )
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        ms = 1e3 * np.asarray(values or [0.0])
        metrics[f"mean_{name}_ms"] = float(np.mean(ms))
        metrics[f"median_{name}_ms"] = float(np.median(ms))
        metrics[f"std_{name}_ms"] = float(np.std(ms))
        metrics[f"p99_{name}_ms"] = float(np.percentile(ms, 99))
    metrics.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_len for r in results],
        ttfts=[r.ttft for r in results],
        itls=[r.itl for r in results],
        errors=[r.error for r in results],
    )
    return metrics


def print_results(m: dict, max_concurrency: int | None) -> None:
    row = lambda label, value, fmt="": print(f"{label:<40} {value:<10{fmt}}")  # noqa: E731
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
    ):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        upper = name.upper()
        row(f"Mean {upper} (ms):", m[f"mean_{name}_ms"], ".2f")
        row(f"Median {upper} (ms):", m[f"median_{name}_ms"], ".2f")
        row(f"P99 {upper} (ms):", m[f"p99_{name}_ms"], ".2f")
    print("=" * 50)


def server_gauges(base_url: str) -> dict[str, float]:
    """KV-cache usage (the fullest engine's) and running / waiting requests (all engines')
    from the server's /metrics (empty if none)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    found = {}
    for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        values = re.findall(rf"^(?:jaxserve|vllm):{name}{{[^}}]*}} (\S+)$", text, re.M)
        if values:
            combine = max if name == "kv_cache_usage_perc" else sum
            found[name] = float(combine(float(v) for v in values))
    return found


def drained_gauges(base_url: str, wait_s: float = 10.0) -> dict[str, float]:
    """The gauges once nothing runs (or after wait_s): KV usage must then be back to 0."""
    deadline = time.monotonic() + wait_s
    while True:
        gauges = server_gauges(base_url)
        busy = gauges.get("num_requests_running", 0) or gauges.get("kv_cache_usage_perc", 0)
        if not busy or time.monotonic() > deadline:
            return gauges
        time.sleep(0.25)


def served_model(base_url: str) -> str:
    models = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    return models[0]["id"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser("serve", __doc__)
    parser.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument(
        "--random-vocab-size",
        type=int,
        default=10000,
        help="prompt token ids are drawn below this (keep it within the model's vocabulary)",
    )
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default=None)
    args = parser.parse_args(argv)
    if not 0.0 <= args.random_range_ratio < 1.0:
        parser.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model = args.model or served_model(args.base_url)
    requests = sample_requests(args)
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness}")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    results, duration = asyncio.run(benchmark(args, model, requests))
    metrics = summarize(results, duration)
    print_results(metrics, args.max_concurrency)
    gauges = drained_gauges(args.base_url)
    if "kv_cache_usage_perc" in gauges:
        usage = 100 * gauges["kv_cache_usage_perc"]
        print(f"{'KV cache usage after the run (%):':<40} {usage:<10.1f}")
    errors = sorted({e for e in metrics["errors"] if e})
    for e in errors[:5]:
        print(f"error: {e}")
    result = dict(
        date=datetime.now().strftime("%Y%m%d-%H%M%S"),
        model_id=model,
        base_url=args.base_url,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        server_after_run=gauges,
        **metrics,
    )
    if args.save_result:
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
        name = args.result_filename or (
            f"jaxserve-{rate}qps-{model.replace('/', '_')}-{result['date']}.json"
        )
        path = Path(args.result_dir) / name
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {path}")
    return result


if __name__ == "__main__":
    main()
