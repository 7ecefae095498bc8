from pallas_kernels.paged_attention.kernel import ragged_paged_attention
from pallas_kernels.paged_attention.reference import ragged_paged_attention_reference

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference"]
