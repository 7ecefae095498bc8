import os
import pkgutil

# Four host "devices" for the tensor-parallel tests, and XLA:CPU's cheapest code generation:
# LLVM -O0 and the classic (not the MLIR "fusion") emitters compile the suite's steps 35%
# faster than -O1 (tests/models/test_family_generate.py, test_tiny_models.py and
# test_llama_parity.py from a cold cache: 137 -> 90 s) with the same results: XLA:CPU allows
# no fast-math reassociation at any level; the suite measures no speed. And Eigen's matrix
# products on one thread: two xdist workers (and their engine subprocesses) share CI's two
# cores, and each process's second Eigen thread only contends with the other (the default
# model's decode beside a second one: 13.9 -> 10.9 s for 128 steps of 4 rows; alone 8.8 ->
# 7.9 s). Before jax's import.
# The CUDA plugin parses XLA_FLAGS with its own flag set, which lacks XLA:CPU's: on a machine
# with the plugin (the GPU suite) only the device count is set.


def _cuda_plugin() -> bool:
    try:
        import jax_plugins
    except ImportError:
        return False
    return any(m.name.startswith("xla_cuda") for m in pkgutil.iter_modules(jax_plugins.__path__))


def _jaxlib_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in version("jaxlib").split(".")[:2])


_FLAGS = {"xla_force_host_platform_device_count": "4"}
if not _cuda_plugin():
    _FLAGS |= {"xla_backend_optimization_level": "0", "xla_cpu_multi_thread_eigen": "false"}
    if _jaxlib_version() < (0, 11):  # jaxlib 0.11 has no such flag (and aborts on it)
        _FLAGS["xla_cpu_use_fusion_emitters"] = "false"
        # One object file per executable, not LLVM's parallel split: a live tiny engine
        # then holds ~3.3k memory mappings, not ~6.3k, and an xdist worker with several
        # engines alive stays far from the kernel's 65530 (vm.max_map_count; a worker
        # reached 62.8k, and XLA:CPU dies with SIGSEGV loading an executable past it);
        # cold compiles are no slower (4 engine starts: 16.3 -> 14.9 s)
        _FLAGS["xla_cpu_parallel_codegen_split_count"] = "1"
for _flag, _value in _FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()

# No model hub is reachable from the suite's machines: hub ids resolve from caches the tests
# build (tests/transformers_utils/test_hub.py), and nothing waits on a network timeout.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# torch (the HF references) on one thread: its second thread only spins beside the other
# xdist worker (HF generate of the default model: the same wall time, half the CPU).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Engines compile only the step shapes that serve any step (envs.JAXSERVE_MINIMAL_COMPILE): the
# suite starts ~100 engines, most on a cold compile cache in CI. The tests of compilation set
# it back to "0" (tests/worker/test_executable_cache.py); subprocess servers inherit it.
os.environ.setdefault("JAXSERVE_MINIMAL_COMPILE", "1")

# Half a GiB of KV cache for engines given no budget (1 GiB by default): each of the ~40
# default-model engines of a run zero-fills it, and CI's 24 GiB hold both workers' engines and
# their servers. The default model's 8192-token context still fits (513 of 711 blocks).
os.environ.setdefault("JAXSERVE_CPU_KVCACHE_SPACE", "0.5")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices()) if _backend_ok("gpu") else False
    skip_gpu = pytest.mark.skip(reason="needs a GPU (none visible to jax)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


def _backend_ok(name: str) -> bool:
    try:
        jax.devices(name)
        return True
    except RuntimeError:
        return False


@pytest.fixture(scope="session")
def cpu_devices():
    return jax.devices("cpu")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under --dist loadfile, the longest files first (tests/schedule.py). Optional: the GPU
    machine's pytest has no xdist (gpu_suite.sh's pytest steps run there)."""
    if config.getvalue("dist") == "loadfile":
        from tests.schedule import LongestFileFirst

        return LongestFileFirst(config, log)
    return None


def pytest_configure(config):
    if os.environ.get("JAXSERVE_RECORD_DURATIONS") and not hasattr(config, "workerinput"):
        from tests.schedule import DurationRecorder

        config.pluginmanager.register(DurationRecorder(os.environ["JAXSERVE_RECORD_DURATIONS"]))
