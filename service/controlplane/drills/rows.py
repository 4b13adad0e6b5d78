"""How a drill report reads in the terminal: ``what | value`` rows, built by each drill kind
(``Drill.rows``) and drawn by ``service.view.drill_table``."""

from __future__ import annotations

from rich.text import Text

Row = tuple[str, "str | Text"]

EQUAL = {True: Text("yes", style="green"), False: Text("NO", style="red")}
"""How a drill's fingerprints_equal reads."""


def secs(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "-"


def shown(value) -> str:
    return str(value) if value is not None else "-"


def norm(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.3g}"


def per_group(values: dict, fmt: str) -> str:
    return ", ".join(f"g{g} {format(v, fmt) if v is not None else '-'}" for g, v in sorted(values.items())) or "-"


def none_is_good(items: list) -> Text:
    """A list that should be empty: green "none", or the items in red."""
    return Text(", ".join(map(str, items)), style="red") if items else Text("none", style="green")
