"""The README's headline numbers are the committed results' (``bench/headline.py``)."""

from __future__ import annotations

from bench.headline import readme_table, rows, table
from cluster import REPO


def test_the_readmes_headline_table_is_rendered_from_the_committed_results():
    assert readme_table((REPO / "README.md").read_text()) == table(), "run python -m bench.headline --write"
    assert all((REPO / "bench" / "results" / name).is_file() for _, _, name in rows())
