"""The test tiers hold: every test module sits in a tier's folder, and the tables of
slow and mounting tests name tests that exist."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ALSO_MOUNT, SLOW, TIERS

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_is_in_a_tier() -> None:
    stray = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
             if p.parent.parent != TESTS or p.parent.name not in TIERS]
    assert stray == [], f"move these into tests/{{{','.join(TIERS)}}}/"


def test_the_tables_name_real_tests() -> None:
    tests = set()
    for p in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                tests.add(f"{p.name}::{node.name}")
    assert sorted((SLOW | ALSO_MOUNT) - tests) == []
