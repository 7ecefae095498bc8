"""jaxserve/config is a package at the bottom of the import floors: its public names import
from `jaxserve.config` and it pulls in nothing of jaxserve but itself and `jaxserve.envs`."""

import subprocess
import sys

import pytest

from jaxserve.config import KV_CONNECTORS, KVTransferConfig, ParallelConfig


def test_imports_nothing_of_jaxserve_above_it():
    own = ("jaxserve.config", "jaxserve.envs", "jaxserve.version")  # version: the root's
    code = (
        "import sys, jaxserve.config; print(sorted(m for m in sys.modules"
        f" if m.startswith('jaxserve.') and not m.startswith({own!r})"
        " or m.startswith('pallas_kernels')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_kv_connector_names_are_checked_without_importing_a_connector():
    with pytest.raises(ValueError, match="'Nope' is not supported; jaxserve implements Example"):
        KVTransferConfig("Nope")
    assert KVTransferConfig("OffloadingConnector").kv_connector in KV_CONNECTORS


def test_parallel_config_checks_no_devices():
    """Whether this process has the devices is checked where the engine config is resolved
    (distributed/mesh.py::check_local_devices, tests/engine/test_arg_utils.py)."""
    assert ParallelConfig(tensor_parallel_size=64, nnodes=2).nnodes == 2
    with pytest.raises(
        ValueError, match="tensor_parallel_size=1 x pipeline_parallel_size=1 cannot span nnodes=2"
    ):
        ParallelConfig(tensor_parallel_size=1, nnodes=2)
