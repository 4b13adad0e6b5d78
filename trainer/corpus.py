"""Reading the training text: a user's files, or the Python standard library's own sources.

No torch import: the launcher checks ``--data`` before it starts torchrun.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from trainer.errors import ConfigError

_preloaded: dict[tuple[Path | None, int], bytes] = {}
"""Corpora a zygote read before forking: its ranks share these pages and read nothing."""

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl", ".json", ".csv", ".tex", ".html"}


def stdlib_files() -> list[Path]:
    """The Python standard library's own sources: a real corpus on every machine, no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def _jsonl_text(raw: bytes, path: Path) -> bytes:
    parts = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{number} is not JSON ({err.msg}); JSONL needs one object per line") from err
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"{path}:{number} has no string 'text' field")
        parts.append(text.encode())
    return b"\n".join(parts)


def _user_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ConfigError(f"--data {path} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
        return files
    raise ConfigError(f"--data {path} does not exist; give a text or JSONL file or a folder of them")


def preload_corpus(path: Path | None, max_bytes: int) -> bytes:
    """Read the corpus now and keep it: every later :func:`read_corpus` of it in this process,
    or in a process forked from it, answers from memory."""
    _preloaded[(path, max_bytes)] = corpus = read_corpus(path, max_bytes)
    return corpus


def read_corpus(path: Path | None, max_bytes: int) -> bytes:
    """Read up to ``max_bytes`` of the corpus: the user's files, else the standard library."""
    if (path, max_bytes) in _preloaded:
        return _preloaded[(path, max_bytes)]
    files = stdlib_files() if path is None else _user_files(path)
    chunks: list[bytes] = []
    total = 0
    for file in files:
        try:
            raw = file.read_bytes()
        except OSError as err:
            raise ConfigError(f"cannot read --data file {file}: {err.strerror}") from err
        if file.suffix == ".jsonl":
            raw = _jsonl_text(raw, file)
        chunks.append(raw)
        total += len(raw) + 1
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]
