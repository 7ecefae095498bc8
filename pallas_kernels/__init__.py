"""Pallas kernels for jaxserve, each with a pure-jnp reference of the same signature."""
