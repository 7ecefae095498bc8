"""TEMPORARY stub until H1's envs.py lands (lead's working copy)."""

import os
from typing import Any

_DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")
environment_variables = {
    "JAXSERVE_COMPILE_CACHE": lambda: os.environ.get("JAXSERVE_COMPILE_CACHE", _DEFAULT_CACHE),
    "JAXSERVE_SIMULATED_STEP": lambda: os.environ.get("JAXSERVE_SIMULATED_STEP"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(name)
