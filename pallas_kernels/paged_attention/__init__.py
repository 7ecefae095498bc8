from pallas_kernels.paged_attention.reference import ragged_paged_attention_reference

# The kernel needs Pallas' Triton backend (jax.experimental.pallas.triton). A jax without it
# must still import jaxserve and run on CPU with the reference; asking for the kernel then
# raises an ImportError that names what is missing.
PALLAS_IMPORT_ERROR: ImportError | None = None
try:
    from pallas_kernels.paged_attention.kernel import ragged_paged_attention
except ImportError as e:
    if not (e.name or "").startswith("jax"):
        raise  # a bug of ours, not a missing jax module
    PALLAS_IMPORT_ERROR = e

    def ragged_paged_attention(*args, **kwargs):
        raise ImportError(pallas_unavailable_message()) from PALLAS_IMPORT_ERROR


def pallas_unavailable_message() -> str | None:
    """Why the Pallas kernel cannot run here, or None when it can."""
    if PALLAS_IMPORT_ERROR is None:
        return None
    import jax

    return (
        f"the Pallas paged-attention kernel needs {PALLAS_IMPORT_ERROR.name or 'a jax module'} "
        f"(Pallas' Triton backend), which jax {jax.__version__} cannot import "
        f"({PALLAS_IMPORT_ERROR}); use --attention-backend reference"
    )


__all__ = [
    "PALLAS_IMPORT_ERROR",
    "pallas_unavailable_message",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
