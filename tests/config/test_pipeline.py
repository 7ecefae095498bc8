"""Pipeline parallelism's layer split (config/pipeline.py): vLLM's rule and its override."""

import pytest

from jaxserve.config.pipeline import pp_layer_partition


@pytest.mark.parametrize(
    ("layers", "pp", "counts"),
    [(32, 1, [32]), (32, 4, [8, 8, 8, 8]), (30, 4, [7, 8, 8, 7]), (5, 2, [3, 2]),
     (10, 3, [3, 4, 3]), (4, 4, [1, 1, 1, 1])],
)  # fmt: skip
def test_vllms_split_gives_the_remainder_to_the_stages_before_the_last(layers, pp, counts):
    stages = pp_layer_partition(layers, pp, override="")
    assert [len(r) for r in stages] == counts
    assert [i for r in stages for i in r] == list(range(layers))  # contiguous, in order


def test_the_override_sets_each_stages_layers(monkeypatch):
    monkeypatch.setenv("JAXSERVE_PP_LAYER_PARTITION", "1,5,2")
    assert pp_layer_partition(8, 3) == [range(0, 1), range(1, 6), range(6, 8)]


@pytest.mark.parametrize(
    ("layers", "pp", "override", "match"),
    [(8, 3, "1,5", "3 stages"), (8, 2, "4,5", "8 layers"), (8, 2, "8,0", "at least"),
     (8, 2, "a,b", "comma-separated"), (2, 3, "", "exceeds the model's 2 layers"),
     (8, 0, "", "at least 1")],
)  # fmt: skip
def test_a_bad_split_is_refused_naming_it(layers, pp, override, match):
    with pytest.raises(ValueError, match=match):
        pp_layer_partition(layers, pp, override=override)
