"""The package's layers (pyproject.toml's [tool.importlinter]) are kept: import-linter finds no
upward import and no cycle, and it does find one of each when a copy of the tree has one."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_layers_and_no_cycles_contracts_are_kept():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture
def tree(tmp_path):
    for package in ("jaxserve", "pallas_kernels"):
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))  # fmt: skip
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n\ndef _added():\n    {line}\n")


def test_an_upward_import_breaks_the_layers(tree):
    # a lazy import is still a dependency: the scheduler reaching up into the model runner
    append(tree / "jaxserve/core/scheduler.py", "from jaxserve.worker import model_runner")
    result = lint(tree)
    assert result.returncode == 1
    assert "jaxserve.core is not allowed to import jaxserve.worker" in result.stdout


def test_a_cycle_inside_one_floor_breaks_the_acyclic_contract(tree):
    # buckets <- batch_builder is fine; buckets -> batch_builder closes a cycle in jaxserve.worker
    append(tree / "jaxserve/worker/buckets.py", "from jaxserve.worker import batch_builder")
    result = lint(tree)
    assert result.returncode == 1
    assert "No cycles are allowed in jaxserve.worker" in result.stdout
    assert "Each floor imports only the floors below it KEPT" in result.stdout
