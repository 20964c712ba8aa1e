"""An attribute's docstring is the string right after its assignment: two strings in a row mean one was orphaned
from its attribute by a line inserted between them (the router's ``_syncs_answered`` went in between
``_kv_liveness`` and "Latest kv.liveness per node", which then read as ``_syncs_answered``'s second docstring; the
worker's ``_started_mono`` and the router's ``_templates`` had done the same to ``_transfer_tag``'s and
``_tag_tokenizer``'s). Sphinx and IDEs take the first string and drop the second."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _is_str(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def test_no_two_docstrings_in_a_row():
    orphans = []
    for root in ("services", "shared", "evolving_infra"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                body = getattr(node, "body", None)
                if isinstance(body, list):
                    orphans += [f"{path.relative_to(REPO)}:{b.lineno}" for a, b in zip(body, body[1:]) if _is_str(a) and _is_str(b)]
    assert orphans == [], f"a string right after another (an attribute's docstring orphaned by a line put before it): {orphans}"
