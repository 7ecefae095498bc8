"""`jaxserve bench serve` as a script (code and docs: jaxserve/benchmarks/serve.py)."""

from jaxserve.benchmarks.serve import main

if __name__ == "__main__":
    main()
