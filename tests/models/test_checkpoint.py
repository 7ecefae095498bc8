"""jaxserve (orbax) checkpoints: `jaxserve convert` writes one, load_model restores it."""

import numpy as np
import pytest

from jaxserve.distributed.mesh import make_mesh
from jaxserve.entrypoints.cli import main as cli_main
from jaxserve.models.loader import load_model
from tests.helpers import make_tiny_hf
from tests.models.test_llama_parity import run_mixed_schedule


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf("llama", tmp_path_factory.mktemp("hf"))


def test_orbax_round_trip_gives_identical_logits(model_dir, tmp_path, cpu_devices):
    dst = tmp_path / "ckpt"
    assert cli_main(["convert", str(model_dir), str(dst), "--dtype", "float32"]) == 0
    assert (dst / "jaxserve_checkpoint.json").exists() and (dst / "config.json").exists()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5]]
    _, before = run_mixed_schedule(load_model(model_dir, dtype="float32"), prompts)
    _, after = run_mixed_schedule(load_model(dst, dtype="float32"), prompts)
    for seq in before:
        np.testing.assert_array_equal(after[seq], before[seq])
    # Restores straight into a tp=2 sharding.
    sharded = load_model(dst, dtype="float32", mesh=make_mesh(2, cpu_devices))
    qkv = sharded.model.layers[1].self_attn.qkv_proj.kernel[...]
    assert qkv.sharding.spec[1] == "tp" and len(qkv.addressable_shards) == 2
    _, restored = run_mixed_schedule(sharded, prompts)
    for seq in before:
        np.testing.assert_allclose(restored[seq], before[seq], atol=1e-5, rtol=0)
