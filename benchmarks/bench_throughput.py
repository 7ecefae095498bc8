"""`jaxserve bench throughput` as a script (code and docs: jaxserve/benchmarks/throughput.py)."""

from jaxserve.benchmarks.throughput import main

if __name__ == "__main__":
    main()
