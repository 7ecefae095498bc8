"""Pipeline parallelism's layer split (`--pipeline-parallel-size`, `-pp`): which decoder layers
each stage runs, by vLLM's rule, or as JAXSERVE_PP_LAYER_PARTITION gives them.

vLLM's rule: every stage gets num_layers // pp layers; the remainder goes one layer each to
the stages before the last, from the second-to-last backwards (the last stage also runs the
final norm, the LM head and the sampler). 30 layers over 4 stages: 7, 8, 8, 7.
"""

from __future__ import annotations

from jaxserve import envs


def pp_layer_partition(num_layers: int, pp: int, override: str | None = None) -> list[range]:
    """The layers of each of the pp stages, contiguous and in order. override (default
    $JAXSERVE_PP_LAYER_PARTITION): the layer count of every stage, comma-separated ("7,9,9,5"),
    summing to num_layers, each at least 1."""
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {pp}")
    if pp > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers: every "
            "stage needs at least one"
        )
    override = envs.JAXSERVE_PP_LAYER_PARTITION if override is None else override
    if override:
        try:
            counts = [int(c) for c in override.split(",")]
        except ValueError:
            raise ValueError(
                f"JAXSERVE_PP_LAYER_PARTITION={override!r} is not comma-separated layer counts"
            ) from None
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"JAXSERVE_PP_LAYER_PARTITION={override!r} must give {pp} stages of at least "
                f"one layer each, {num_layers} layers in all"
            )
    else:
        counts = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            counts[-i] += 1
    bounds = [sum(counts[:i]) for i in range(pp + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(pp)]
