"""The package version (pyproject.toml's), in a module that imports nothing, so any layer
(the CLI, the HTTP server's /version) can read it without importing the `jaxserve` package's
lazy top-level names."""

__version__ = "0.1.0"
