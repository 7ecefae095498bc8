"""`jaxserve bench latency` as a script (code and docs: jaxserve/benchmarks/latency.py)."""

from jaxserve.benchmarks.latency import main

if __name__ == "__main__":
    main()
