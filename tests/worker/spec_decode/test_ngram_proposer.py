"""Prompt-lookup drafting and --speculative-config validation."""

import numpy as np
import pytest

from jaxserve.config import SpeculativeConfig
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.worker.spec_decode.ngram_proposer import NgramProposer


@pytest.mark.parametrize(
    ("tokens", "k", "min_n", "max_n", "draft"),
    [
        ([1, 2, 3, 4, 1, 2, 3], 3, 1, 3, [4, 1, 2]),  # longest suffix 1 2 3 -> what followed
        ([1, 2, 3, 4, 1, 2, 3], 8, 1, 3, [4, 1, 2, 3]),  # fewer than k near the end
        ([5, 9, 7, 5, 8, 5], 2, 1, 3, [8, 5]),  # latest earlier occurrence of 5
        ([1, 2, 9, 2, 1, 2], 2, 2, 2, [9, 2]),  # n = 2 only: "1 2" at 0
        ([1, 2, 3, 4], 3, 1, 3, []),  # nothing repeats
        ([7, 8, 7], 3, 2, 3, []),  # "7" repeats but min_n = 2
        ([6], 3, 1, 3, []),
    ],
)
def test_ngram_drafts(tokens, k, min_n, max_n, draft):
    assert NgramProposer(k, min_n, max_n).propose_tokens(np.array(tokens, np.int32)) == draft


def test_ngram_prefers_the_longest_match():
    # "3" last occurred before 0, but "2 3" before 9: the longer match wins.
    tokens = np.array([2, 3, 9, 5, 3, 0, 1, 2, 3], np.int32)
    assert NgramProposer(1, 1, 2).propose_tokens(tokens) == [9]
    assert NgramProposer(1, 1, 1).propose_tokens(tokens) == [0]


def test_speculative_config_defaults_and_vllm_spellings():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.parse({"model": "ngram", "num_speculative_tokens": 2,
                                 "prompt_lookup_max": 4})  # fmt: skip
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                 "prompt_lookup_min": 2})  # fmt: skip
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method 'medusa' is not supported"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method eagle needs a model"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "method eagle3 needs a model"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "got 0"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "prompt_lookup_min=4 exceeds prompt_lookup_max=2"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "['lookahead']"),
        ({"num_speculative_tokens": 2}, "names no method"),
        ("{not json", "is not JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)  # fmt: skip
def test_bad_speculative_configs_are_named(config, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.parse(config)


def test_ngram_refuses_async_scheduling_and_turns_it_off_by_default():
    """ngram drafts on the host from the tokens the step before accepted: no async
    scheduling (the methods that draft on the devices have it: test_async_spec.py)."""
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="async_scheduling is not supported with speculative"):
        EngineArgs(speculative_config=spec, async_scheduling=True).create_engine_config()
    config = EngineArgs(speculative_config=spec).create_engine_config()
    assert config.speculative.num_speculative_tokens == 2
    assert not config.scheduler.async_scheduling
    with pytest.raises(ValueError, match="generating runner"):
        EngineArgs(speculative_config=spec, runner="pooling").create_engine_config()
