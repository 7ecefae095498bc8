"""Shared pieces of the benchmark scripts (scripts/bench_latency.py, benchmarks/bench_*.py):
the roofline (roofline.py), the HF transformers peer (hf_peer.py) and small helpers (common.py).
"""
