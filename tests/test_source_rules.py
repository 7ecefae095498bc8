"""The source rules: every module under jaxserve/ is formatted by ruff and at most 450 lines as
ruff formats it, and `# fmt: skip` keeps only tables (a literal of data laid out as rows: bucket
lists, dtype maps, name sets), never a signature, a call or an expression packed onto few lines."""

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).parent / "ruff"
MAX_LINES = 450
MAX_MARKERS = 20  # tables kept as written, in all (issue 69)
# where `# fmt: skip` is held to tables
MARKER_TREES = ("jaxserve", "pallas_kernels")
_MARKER = re.compile(r"#\s*fmt:\s*skip\s*$")


def _row(node: ast.expr) -> bool:
    """A table's row: a constant, or a tuple / list led by one (a key and its values)."""
    if isinstance(node, ast.Constant):
        return True
    return isinstance(node, ast.Tuple | ast.List) and bool(node.elts) and _row(node.elts[0])


def _is_table(value: ast.expr) -> bool:
    """A literal of data: a dict keyed by constants or enum members (`**` spreads aside), or a
    list / tuple / set of rows; wrapped in one call at most (frozenset({...}))."""
    if isinstance(value, ast.Call) and len(value.args) == 1 and not value.keywords:
        value = value.args[0]
    if isinstance(value, ast.Dict):
        keys = [k for k in value.keys if k is not None]
        return bool(keys) and all(isinstance(k, ast.Constant | ast.Attribute) for k in keys)
    if isinstance(value, ast.List | ast.Tuple | ast.Set):
        return bool(value.elts) and all(_row(e) for e in value.elts)
    return False


def misplaced_markers(source: str) -> list[int]:
    """The lines whose `# fmt: skip` is not on the last line of an assignment of a table (on a
    def, a call, an expression, or inside a statement, where ruff ignores it)."""
    lines = [
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and _MARKER.search(tok.string)
    ]
    if not lines:
        return []
    tables = {
        node.end_lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and node.value is not None
        and _is_table(node.value)
    }
    return [line for line in lines if line not in tables]


def _modules(*trees: str) -> list[Path]:
    return sorted(p for tree in trees for p in (ROOT / tree).rglob("*.py"))


def test_jaxserve_is_formatted_and_no_module_is_over_450_lines():
    result = subprocess.run(
        [str(RUFF), "format", "--check", "jaxserve", "pallas_kernels"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules("jaxserve")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_fmt_skip_is_only_on_tables():
    misplaced = {
        str(p.relative_to(ROOT)): lines
        for p in _modules(*MARKER_TREES)
        if (lines := misplaced_markers(p.read_text()))
    }
    assert not misplaced, f"`# fmt: skip` off a table (file: lines): {misplaced}"
    count = sum(p.read_text().count("# fmt: skip") for p in _modules(*MARKER_TREES))
    assert count <= MAX_MARKERS, f"{count} '# fmt: skip' markers (at most {MAX_MARKERS})"


@pytest.mark.parametrize(
    "source",
    [
        "BUCKETS = [1, 2, 4,\n           8, 16]  # fmt: skip\n",
        'DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16,\n'
        '          "I8": np.int8}  # fmt: skip\n',
        'NAMES = frozenset({"a", "b",\n                   "c"})  # fmt: skip\n',
        'ROUTES = [("/a", a, get),\n          ("/b", b, post)]  # fmt: skip\n',
    ],
)
def test_a_table_may_keep_its_marker(source):
    assert misplaced_markers(source) == []


@pytest.mark.parametrize(
    "source",
    [
        "def f(a, b,\n      c):  # fmt: skip\n    pass\n",
        "f(a, b,\n  c)  # fmt: skip\n",
        "x = g(a, b,\n      c)  # fmt: skip\n",
        "args = (q, k,\n        v)  # fmt: skip\n",
        "body = {**a,\n        **b}  # fmt: skip\n",
        "T = [\n    1,  # fmt: skip\n    2,\n]\n",
    ],
)
def test_a_marker_off_a_table_is_found(source):
    assert misplaced_markers(source) != []
