"""docs/models.md's families table names every architecture the registry serves, and only
those."""

import re
from pathlib import Path

from jaxserve.models.registry import supported_architectures

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_the_families_table_lists_the_registry():
    text = DOC.read_text()
    table = text[text.index("## Families") : text.index("\n\n", text.index("| Family"))]
    rows = [line.split("|")[2] for line in table.splitlines() if line.startswith("| ")][1:]
    heads = "CausalLM|ConditionalGeneration|SequenceClassification"
    names = rf"`(\w+For(?:{heads})|\w+MTPModel)`"  # MTP draft heads: vLLM's names
    documented = {name for row in rows for name in re.findall(names, row)}
    assert documented == set(supported_architectures())
