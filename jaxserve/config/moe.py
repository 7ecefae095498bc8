"""How a mixture-of-experts model routes its tokens and which layers keep a dense MLP, read
from the HF config of each MoE family (layers/fused_moe.py runs it)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config.linear_attention import GATED_DELTA_NET


@dataclasses.dataclass(frozen=True)
class MoeRouting:
    """scoring "softmax": the top-k of a softmax over the router logits (Mixtral, Qwen3-MoE);
    "softmax_group": DeepSeek-V2's: the top-k of the softmax (`greedy`), among the experts
    of the `topk_group` groups whose best score is highest (`group_limited_greedy`), times
    routed_scaling_factor, never renormalised (as HF routes it);
    "sigmoid": DeepSeek-V3's and GLM-4.5's `noaux_tc`: sigmoid scores, the experts picked by
    score + `e_score_correction_bias` among the `topk_group` best of `n_group` expert groups (a
    group's merit: its two best biased scores), weighted by their unbiased scores
    (renormalised when norm_topk_prob) times routed_scaling_factor. shared_intermediate: the
    width of the shared experts' MLP, which every token goes through too (0: none).

    gpt-oss's experts: `biases` (the router's logits and each expert's gate/up and down
    projections have biases) and `swiglu_limit` (not None: the gate is clamped above at the
    limit, up to [-limit, limit], and an expert computes (up + 1) * gate * sigmoid(alpha *
    gate), alpha = swiglu_alpha). Its routing is the softmax's: a softmax over the top-k
    logits equals the top-k of the softmax over all, renormalised.

    scoring "sigmoid_topk" (Llama 4): the top-k router logits, each weighted by its sigmoid;
    `scale_inputs`: the weight multiplies the expert's input instead of its output."""

    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate: int = 0
    biases: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    scale_inputs: bool = False
    shared_gate: bool = False  # the shared experts' output times sigmoid(x . w) (Qwen3-Next)

    @property
    def score_bias(self) -> bool:
        return self.scoring == "sigmoid"


# Architectures routed as DeepSeek-V3 routes (sigmoid, bias, groups, shared experts).
NOAUX_TC = (
    "Glm4MoeForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",
)
# DeepSeek-V2's: softmax scores, greedy top-k (among the best groups), shared experts.
DEEPSEEK_V2 = "DeepseekV2ForCausalLM"


def moe_routing(hf_config: Any, architecture: str) -> MoeRouting:
    if architecture == "GptOssForCausalLM":
        return MoeRouting(
            biases=True,
            swiglu_limit=float(hf_config.swiglu_limit),
            swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
        )
    if architecture == "MiniMaxM2ForCausalLM":  # sigmoid scores, biased choice, no groups
        return MoeRouting(scoring="sigmoid")
    if architecture in GATED_DELTA_NET:  # Qwen3-Next's and Qwen3.5's gated shared expert
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
        return MoeRouting(shared_intermediate=shared, shared_gate=bool(shared))
    if architecture not in (*NOAUX_TC, DEEPSEEK_V2):
        return MoeRouting()
    v2 = architecture == DEEPSEEK_V2
    methods = ("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)
    method = getattr(hf_config, "topk_method", methods[0])
    if method not in methods:
        raise ValueError(
            f"topk_method {method!r} is not supported for {architecture} ({', '.join(methods)})"
        )
    for field, want in (("scoring_func", "softmax" if v2 else "sigmoid"), ("moe_layer_freq", 1)):
        if getattr(hf_config, field, want) != want:  # DeepSeek's own configs name them
            raise ValueError(
                f"{field} {getattr(hf_config, field)!r} is not supported for {architecture} "
                f"({want!r})"
            )
    grouped = method != "greedy"
    n_group = int(getattr(hf_config, "n_group", 1) or 1) if grouped else 1
    topk_group = int(getattr(hf_config, "topk_group", 1) or 1) if grouped else 1
    experts = int(hf_config.n_routed_experts)
    if experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"n_group={n_group}, topk_group={topk_group} do not split {experts} routed experts "
            "into groups"
        )
    if n_group > 1 and experts // n_group < 2 and not v2:
        raise ValueError(f"n_group={n_group}: a group's merit needs 2 experts in each group")
    shared = int(getattr(hf_config, "n_shared_experts", 0) or 0)
    return MoeRouting(
        scoring="softmax_group" if v2 else "sigmoid",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
        shared_intermediate=shared * int(hf_config.moe_intermediate_size),
    )


def first_dense_layers(hf_config: Any, architecture: str) -> tuple[int, ...]:
    """Leading layers with a dense MLP (`first_k_dense_replace`: DeepSeek, GLM-4.5)."""
    if architecture not in (*NOAUX_TC, DEEPSEEK_V2):
        return ()
    return tuple(range(int(getattr(hf_config, "first_k_dense_replace", 0) or 0)))
