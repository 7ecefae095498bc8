"""How the suite's test files are shared between its xdist workers (tests/conftest.py).

xdist's `--dist loadfile` sends files in order of their number of tests, and sends a worker
its next file while it still has two tests to run. The suite's slowest files have the fewest
tests (a server, a venv, the GPU suite's dry run: one or two each), so they came last, queued
behind each other on one worker while the other sat idle: 80 s of a 750 s run. Here files go
longest first, by the seconds each took in a recorded run (tests/durations.json; a file not
in it counts as `NEW_FILE_S`), the files of `APART` never side by side, and a worker gets its
next file only when it is on the last test of its current one (the test xdist holds back
until it knows what follows it).

Refresh the durations after a change that moves them much:
    JAXSERVE_RECORD_DURATIONS=tests/durations.json .venv/bin/python -m pytest
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

DURATIONS = Path(__file__).with_name("durations.json")
NEW_FILE_S = 10.0
# Files whose long default-model decodes each take the memory bandwidth of a core's share:
# never two at once (side by side at the start, test_llm ran 188 -> 226 s, test_spec_decode
# 90 -> 127 s).
APART = {"tests/entrypoints/test_llm.py", "tests/worker/spec_decode/test_spec_decode.py"}


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class LongestFileFirst(LoadScopeScheduling):
    """--dist loadfile, longest file first, one file ahead at most."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    def _split_scope(self, nodeid: str) -> str:
        return _file(nodeid)

    def _seconds(self, scope: str) -> float:
        return float(self.seconds.get(scope, NEW_FILE_S))

    def _running(self, node) -> set[str]:
        """The files `node` has tests of still to run."""
        work = self.assigned_work.get(node, {})
        return {scope for scope, tests in work.items() if not all(tests.values())}

    def _assign_work_unit(self, node) -> None:
        others = set().union(*(self._running(n) for n in self.assigned_work if n is not node))
        choices = list(self.workqueue)
        if others & APART:
            choices = [scope for scope in choices if scope not in APART] or choices
        longest = max(choices, key=self._seconds)  # the first of equals
        self.workqueue.move_to_end(longest, last=False)
        super()._assign_work_unit(node)  # sends the queue's first

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) <= 1:
            self._assign_work_unit(node)


class DurationRecorder:
    """Seconds per test file (setup, call and teardown of each test), written as JSON."""

    def __init__(self, path: str):
        self.path, self.seconds = Path(path), Counter()

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[_file(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        ordered = {k: round(v, 1) for k, v in sorted(self.seconds.items())}
        self.path.write_text(json.dumps(ordered, indent=0) + "\n")
