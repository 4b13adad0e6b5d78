"""Settings parsing with one-line errors, for every command of the project."""

from __future__ import annotations

import sys
from typing import NoReturn, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliApp

S = TypeVar("S", bound=BaseSettings)


def describe_validation_error(err: ValidationError, skip: int = 0) -> str:
    """``--steps: Input should be greater than or equal to 1 (got '0')`` for the first error;
    ``skip`` leading parts of its location are not flags (a subcommand's name)."""
    first = err.errors()[0]
    loc = first["loc"][skip:]
    where = "--" + "-".join(str(p) for p in loc).replace("_", "-") if loc else ""
    got = first.get("input")
    got_text = f" (got {got!r})" if isinstance(got, (str, int, float)) else ""
    extra = f"; and {len(err.errors()) - 1} more" if len(err.errors()) > 1 else ""
    return f"{where}: {first['msg']}{got_text}{extra}".lstrip(": ")


def fail(prog: str, message: str, code: int = 2) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def parse_settings(cls: type[S], prog: str, argv: list[str]) -> S:
    """Parse CLI flags and environment into ``cls``; exit 2 with one line when invalid.

    For a ``cls`` of subcommands, an error names the subcommand: ``ftctl drill: error: --mtbf: …``.
    """
    try:
        return CliApp.run(cls, cli_args=argv)
    except ValidationError as err:
        loc = err.errors()[0]["loc"]
        if loc and argv and loc[0] == argv[0] and loc[0] in cls.model_fields:
            fail(f"{prog} {loc[0]}", describe_validation_error(err, skip=1))
        fail(prog, describe_validation_error(err))
