"""LoRA's decode-step cost against the base model (code and docs: jaxserve/benchmarks/lora.py)."""

from jaxserve.benchmarks.lora import main

if __name__ == "__main__":
    main()
