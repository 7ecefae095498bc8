"""A request whose own work raises in the scheduler (its KV connector's calls, its grammar, its
results) finishes alone with finish_reason "error" and the exception, its blocks freed; the
requests beside it get exactly the tokens they get without it. A scripted stand-in for the
model runner (tests/core/test_scheduler.py's drain_outputs), no engine."""

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from jaxserve.ipc.messages import KVConnectorStats
from jaxserve.sampling_params import StructuredOutputsParams
from tests.core.test_scheduler import BS, assert_pool_clean, drain_outputs, make_scheduler, req


class FlakyConnector:
    """A KV connector (core/kv_connector.py's calls) that raises in `fail[request id]`'s call.
    Requests named "remote*" load 2 blocks asynchronously (get_finished_recving reports
    `results` (request id -> tokens) for those, else every block loaded), "bad*" 1 block at
    once."""

    def __init__(self, fail: dict[str, str], results: dict | None = None, policy="recompute"):
        self.config = SimpleNamespace(kv_load_failure_policy=policy)
        self.fail, self.results = fail, results or {}
        self.loading: dict[str, int] = {}
        self.finished: list[str] = []

    def _call(self, name: str, request) -> None:
        if self.fail.get(request.request_id) == name:
            raise RuntimeError(f"injected in {name}")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._call("get_num_new_matched_tokens", request)
        if request.request_id.startswith("remote"):
            return 2 * BS, True
        return (BS, False) if request.request_id.startswith("bad") else (0, False)

    def update_state_after_alloc(self, request, block_ids, num_computed, num_external):
        self._call("update_state_after_alloc", request)
        if request.request_id.startswith("remote"):
            self.loading[request.request_id] = num_external

    def get_finished_recving(self):
        if "get_finished_recving" in self.fail.values() and self.loading:
            raise RuntimeError("injected in get_finished_recving")
        done = {r: self.results.get(r, n) for r, n in self.loading.items()}
        self.loading = {}
        return done

    def build_connector_meta(self, requests, block_ids_of):
        return None

    def request_finished(self, request):
        self.finished.append(request.request_id)
        self._call("request_finished", request)
        return None

    def request_preempted(self, request):
        pass

    def take_stats(self):
        return KVConnectorStats()


class FlakyGrammars:
    """The structured-output manager's calls the scheduler makes; raises for `fail`'s request:
    at grammar_init, or at its output token number `advance_at`."""

    def __init__(self, fail: str, advance_at: int | None = None):
        self.fail, self.advance_at = fail, advance_at

    def grammar_init(self, request):
        if request.request_id == self.fail and self.advance_at is None:
            raise RuntimeError("injected in grammar_init")
        compiled = Future()
        compiled.set_result(None)
        request.structured_output_request = SimpleNamespace(is_ready=True, future=compiled)

    def advance(self, request, token):
        if request.request_id == self.fail and request.num_output_tokens == self.advance_at:
            raise RuntimeError("injected in advance")
        return False

    def valid_drafts(self, request, drafts):
        return drafts


def next_token(req_id, i):
    return 20 + (len(req_id) * 7 + i) % 30


def run(connector=None, grammars=None, requests=(), pipelined=True, constrained=()):
    """constrained: the ids of the requests with a grammar (a JSON schema)."""
    sched = make_scheduler(num_blocks=40, max_tokens=16, max_seqs=4)
    sched.grammars.manager = grammars
    if connector is not None:
        sched.connector = connector
    for i, (req_id, n_prompt) in enumerate(requests):
        grammar = (
            StructuredOutputsParams(json={"type": "object"}) if req_id in constrained else None
        )
        sched.add_request(
            req(req_id, n_prompt, arrival=float(i), max_tokens=6, structured_outputs=grammar)
        )
    tokens, reasons, _ = drain_outputs(sched, next_token, pipelined=pipelined)
    assert_pool_clean(sched)  # every block back: the failed requests' too
    return tokens, reasons, sched


HEALTHY = [("ok0", 14), ("ok1", 30), ("ok2", 9)]


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize(
    "call", ["get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"]
)
def test_a_connector_call_that_raises_fails_its_request_alone(call, pipelined):
    expected_tokens, expected_reasons, _ = run(FlakyConnector({}), requests=HEALTHY)
    # One request fails at `call` between the healthy ones; "remote1" loads its KV from
    # another instance meanwhile (the asynchronous path), "remote2" fails on that path.
    fail = {"bad": call, "remote2": call}
    requests = [HEALTHY[0], ("bad", 20), HEALTHY[1], ("remote1", 20), ("remote2", 20), HEALTHY[2]]
    connector = FlakyConnector(fail)
    tokens, reasons, sched = run(connector, requests=requests, pipelined=pipelined)
    for bad in ("bad", "remote2"):
        assert reasons.pop(bad) == f"error: RuntimeError: injected in {call}"
        assert bad in connector.finished  # the connector forgets it
    assert reasons.pop("remote1") == "length" and len(tokens["remote1"]) == 6
    assert reasons == expected_reasons
    assert {r: tokens[r] for r in reasons} == expected_tokens
    # the engine goes on: a request after them runs as any other
    sched.add_request(req("after", 12, max_tokens=6))
    assert drain_outputs(sched, next_token, pipelined=pipelined)[1] == {"after": "length"}


def test_remote_load_results_and_failures_fail_only_their_requests():
    results = {"remote-negative": -5, "remote-huge": 10**9, "remote-none": None}
    requests = [("remote-negative", 20), ("remote-huge", 20), ("remote-none", 20), ("ok", 20)]
    tokens, reasons, _ = run(FlakyConnector({}, results, policy="fail"), requests=requests)
    assert reasons == {
        "remote-negative": "error: RuntimeError: the KV connector loaded -5 tokens",
        "remote-huge": "error: RuntimeError: the KV connector loaded 1000000000 tokens",
        "remote-none": "error: RuntimeError: its KV could not be loaded from the prefill instance",
        "ok": "length",
    }
    # The connector cannot say what arrived: the requests waiting for it fail, no one else.
    broken = FlakyConnector({"any": "get_finished_recving"})
    _, reasons, _ = run(broken, requests=[("remote1", 20), ("ok", 20), ("remote2", 20)])
    assert reasons == {
        "remote1": "error: RuntimeError: injected in get_finished_recving",
        "remote2": "error: RuntimeError: injected in get_finished_recving",
        "ok": "length",
    }


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_grammar_that_raises_fails_its_request_alone(pipelined):
    expected_tokens, expected_reasons, _ = run(requests=HEALTHY, pipelined=pipelined)
    requests = [HEALTHY[0], ("bad", 20), *HEALTHY[1:]]
    # at its third output token (mid-decode, holding blocks), as the grammar advances
    grammars = FlakyGrammars("bad", advance_at=3)
    tokens, reasons, _ = run(None, grammars, requests, pipelined, constrained={"bad"})
    assert reasons.pop("bad") == "error: RuntimeError: injected in advance"
    assert reasons == expected_reasons and {r: tokens[r] for r in reasons} == expected_tokens


def test_a_grammar_that_cannot_start_fails_its_request_at_once():
    sched = make_scheduler()
    sched.grammars.manager = FlakyGrammars("bad")
    json_only = StructuredOutputsParams(json={"type": "object"})
    sched.add_request(req("bad", 8, structured_outputs=json_only))
    assert not sched.has_unfinished_requests()  # never queued; its output waits to be sent
    (out,) = sched.take_pending_outputs()
    assert (out.request_id, out.finish_reason) == ("bad", "error")
    assert out.stop_reason == "RuntimeError: injected in grammar_init"
    assert_pool_clean(sched)
