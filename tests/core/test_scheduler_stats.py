"""The scheduler's stats as the metrics read them: waiting requests counted as vLLM counts
them (the queue and those waiting for remote KV), of them the deferred ones (a grammar still
compiling, KV on its way, no LoRA slot), and each request's preemptions on its outputs. A
scripted stand-in for the model runner (tests/core/test_scheduler.py's), no engine."""

from concurrent.futures import Future
from types import SimpleNamespace

from jaxserve.core.request import Request
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.core.test_scheduler import BS, make_scheduler, req, step
from tests.core.test_scheduler_failures import FlakyConnector


class CompilingGrammars:
    """Grammars that never finish compiling: their requests keep waiting."""

    def grammar_init(self, request):
        request.structured_output_request = SimpleNamespace(is_ready=False, future=Future())


def test_a_request_whose_grammar_compiles_waits_deferred():
    sched = make_scheduler(max_seqs=1)
    sched.grammars.manager = CompilingGrammars()
    grammar = StructuredOutputsParams(json={"type": "object"})
    sched.add_request(req("g", arrival=0.0, structured_outputs=grammar))
    sched.add_request(req("a", arrival=1.0))
    sched.add_request(req("b", arrival=2.0))  # no room: max_num_seqs 1
    step(sched)
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_deferred_reqs) == (1, 2, 1)


def test_a_request_whose_adapter_has_no_slot_waits_deferred():
    sched = make_scheduler()
    sched.max_loras = 1
    for i, name in enumerate("xy"):
        adapter = LoRARequest(name, i + 1, f"/{name}")
        params = SamplingParams(max_tokens=5)
        sched.add_request(
            Request(name, [11] * 10, params, eos_token_id=2, block_size=BS, lora_request=adapter)
        )
    step(sched)
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_deferred_reqs) == (1, 1, 1)


def test_requests_waiting_for_remote_kv_count_as_waiting_and_deferred():
    sched = make_scheduler()
    sched.connector = FlakyConnector({})
    sched.add_request(req("remote0", 12))
    sched.schedule()  # parked until its KV arrives
    assert sched.waiting_for_remote and not sched.running
    stats = sched.make_stats()
    assert (stats.num_waiting_reqs, stats.num_deferred_reqs) == (1, 1)


def test_a_preempted_requests_outputs_carry_its_preemptions():
    # 9 usable blocks of 4 tokens: two 12-token prompts fit, decoding past 16 each does not.
    sched = make_scheduler(num_blocks=10, enable_prefix_caching=False)
    a, b = req("a", 12, max_tokens=12, arrival=1.0), req("b", 12, max_tokens=12, arrival=2.0)
    sched.add_request(a)
    sched.add_request(b)
    outputs = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        outputs += step(sched)[1]
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    last = {o.request_id: o for o in outputs if o.finished}
    assert last["b"].num_preemptions == b.num_preemptions
    assert last["a"].num_preemptions == 0
