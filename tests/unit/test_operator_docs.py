"""docs/operator.md lists every spec field as the schema defines it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llumnix_operator.crd import spec_fields_table

ROOT = Path(__file__).resolve().parents[2]


def test_field_table_in_the_docs_is_current() -> None:
    spec = importlib.util.spec_from_file_location("gen_crd", ROOT / "scripts/gen_crd.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.DOCS_PATH.read_text()
    assert gen.render_docs(text) == text, "run: .venv/bin/python scripts/gen_crd.py"


def test_field_table_covers_nested_fields_with_defaults_and_bounds() -> None:
    table = spec_fields_table()
    assert "| `spec.engine.resources.gpus` | integer | 1 | ≥ 0 | GPUs per instance |" in table
    assert "| `spec.router.port` | integer | 8000 | ≥ 1, ≤ 65535 |" in table
    assert "`spec.dispatch.policy` | string (llumnix \\| infaas++ \\| round-robin" in table
