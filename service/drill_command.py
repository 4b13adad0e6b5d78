"""``ftctl drill KIND``'s flags, made from the drill registry: every field of any kind's request
is a flag (``timeout_s`` → ``--timeout``), described with the kinds that take it."""

from __future__ import annotations

from collections import defaultdict
from typing import Literal, Optional

from pydantic import AliasChoices, Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_settings import CliPositionalArg

from service.client import ApiError, ApiFlags
from service.controlplane.drills import DRILLS


def flag_of(field: str) -> str:
    """The flag a request field is set by: its name without the seconds suffix."""
    return field.removesuffix("_s")


def _flags() -> dict[str, list[tuple[str, FieldInfo]]]:
    """flag → (kind, field) of every kind whose request has it."""
    flags: dict[str, list[tuple[str, FieldInfo]]] = defaultdict(list)
    for kind, drill in DRILLS.items():
        for name, field in drill.Request.model_fields.items():
            if name != "kind":
                flags[flag_of(name)].append((kind, field))
    return flags


def _flag_field(uses: list[tuple[str, FieldInfo]]) -> tuple[type, FieldInfo]:
    """One optional flag (unset: the request's default), described per kind."""
    said: dict[str, list[str]] = defaultdict(list)
    for kind, field in uses:
        said[field.description or ""].append(kind)
    description = "; ".join(f"{', '.join(kinds)}: {text}".rstrip(": ") for text, kinds in said.items())
    annotation = uses[0][1].annotation
    if annotation is bool:
        return bool, Field(False, description=description)
    return Optional[annotation], Field(None, description=description)


class DrillFlags(ApiFlags):
    """What every drill command has besides its kind's fields."""

    as_json: bool = Field(False, validation_alias=AliasChoices("json"), description="print the report's JSON")

    def body(self) -> dict:
        """The request for ``self.kind``, checked here: one line naming the flag if it is wrong."""
        request = DRILLS[self.kind].Request
        fields = {name for name in request.model_fields if name != "kind"}
        flags = set(type(self).model_fields) - set(DrillFlags.model_fields) - {"kind"}
        stray = sorted(f for f in flags if getattr(self, f) not in (None, False)
                       and f not in {flag_of(n) for n in fields})
        if stray:
            raise ApiError(f"drill {self.kind} takes no {', '.join('--' + f.replace('_', '-') for f in stray)}")
        body = {"kind": self.kind, **{n: v for n in fields if (v := getattr(self, flag_of(n))) is not None}}
        try:
            request.model_validate(body)
        except ValidationError as err:
            first = err.errors()[0]
            where = f"--{flag_of(str(first['loc'][0])).replace('_', '-')}: " if first["loc"] else ""
            raise ApiError(f"drill {self.kind}: {where}{first['msg'].removeprefix('Value error, ')}") from None
        return body


def _drill_command() -> type[DrillFlags]:
    return create_model(
        "DrillCommand", __base__=DrillFlags,
        kind=(CliPositionalArg[Literal[tuple(DRILLS)]], Field(description="; ".join(
            f"{kind}: {drill.summary}" for kind, drill in DRILLS.items()))),
        **{flag: _flag_field(uses) for flag, uses in _flags().items()})


DrillCommand = _drill_command()
