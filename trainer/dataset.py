"""A user's text, tokenized once into a file every rank reads by index.

Exactly-once training needs random access: the batch of a step is a function of the step, so a
healed or restarted rank must reach any sample without replaying a stream (torchtitan's
``HuggingFaceTextDataset`` is an iterable, stateful by position). So the text is tokenized once,
as Megatron's and nanoGPT's pipelines do: every document's tokens, with the tokenizer's BOS and
EOS, appended to one flat array of token ids on disk (``tokens.bin``), memory-mapped by the
ranks. A sample is a window of ``seq_len + 1`` tokens; window ``w`` starts at token
``w * seq_len`` (packed, as torchtitan's text dataset packs).

Sources (``--dataset``): a JSONL file (one object per line, its ``--text-field``), a text file
(one document), a Parquet file (a string column), a folder saved by Hugging Face ``datasets``
(``save_to_disk``), or a folder of such files. Without ``--dataset``: the Python standard
library's own sources, a real corpus on every machine.

The cache lives beside the data (``DATA.tokens/``; the standard library's in the user's cache
folder) in a sub-folder named by what decides its content: the sources' names, sizes and times,
the tokenizer, the text field and the byte limit. It is written under a temporary name and
renamed when complete, under a file lock, so concurrent ranks or groups tokenize once and never
read half a cache. No torch import: ``ftctl up``'s check tokenizes before any rank exists.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from trainer.errors import ConfigError

CACHE_FORMAT = 1
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".csv", ".tex", ".html"}
JSONL_SUFFIXES = {".jsonl", ".json"}
PARQUET_SUFFIXES = {".parquet"}
HF_SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json")
"""``datasets.save_to_disk`` writes one of these at the top of the folder."""
STDLIB_MAX_BYTES = 8 * 2**20
"""The default corpus: the first 8 MiB of the standard library's sources."""
PROGRESS_EVERY_S = 1.0
WRITE_CHUNK_TOKENS = 1 << 20


class Tokenizer(Protocol):
    eos_id: int | None

    def encode(self, text: str, add_bos: bool = ..., add_eos: bool = ...) -> list[int]: ...

    def get_vocab_size(self) -> int: ...


Progress = Callable[[float, int, int], None]
"""(fraction of the input read, documents, tokens): called about every second while tokenizing."""


@dataclass(frozen=True)
class DataSource:
    """What ``--dataset`` names (None: the standard library) and how to read it."""

    path: Path | None = None
    text_field: str = "text"
    max_bytes: int | None = None

    @property
    def limit(self) -> int | None:
        return STDLIB_MAX_BYTES if self.path is None and self.max_bytes is None else self.max_bytes

    @property
    def name(self) -> str:
        return "the Python standard library's sources" if self.path is None else str(self.path)

    def files(self) -> list[Path]:
        """The files to read, in order; raises ConfigError for a path that holds none."""
        if self.path is None:
            return _stdlib_sources()
        path = self.path
        if path.is_file():
            return [path]
        if not path.is_dir():
            raise ConfigError(f"--dataset {path} does not exist; give a JSONL, text or Parquet file, a folder saved by "
                              "Hugging Face datasets, or a folder of such files")
        if _is_hf_saved(path):
            return [path]
        readable = TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in readable
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ConfigError(f"--dataset {path} holds no JSONL, text or Parquet files "
                              f"({', '.join(sorted(readable))}) and was not saved by Hugging Face datasets")
        return files

    def identity(self) -> str:
        """Names, sizes and modification times of everything read (up to the byte limit), and how
        it is read."""
        parts = [f"v{CACHE_FORMAT}", self.text_field, str(self.limit)]
        total = 0
        for file in self.files():
            for item in (sorted(p for p in file.rglob("*") if p.is_file()) if file.is_dir() else [file]):
                stat = item.stat()
                parts.append(f"{item}|{stat.st_size}|{stat.st_mtime_ns}")
                total += stat.st_size
            if self.limit is not None and total >= self.limit:
                break
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    def default_cache(self) -> Path:
        if self.path is None:
            base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            return base / "ftservice" / "tokens"
        return self.path.with_name(self.path.name + ".tokens")


def _stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files, in order (its installed packages left out)."""
    found = []
    for folder, dirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(d for d in dirs if d != "site-packages")
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


def _is_hf_saved(folder: Path) -> bool:
    return any((folder / marker).is_file() for marker in HF_SAVED_MARKERS)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def _jsonl_documents(path: Path, field: str) -> Iterator[tuple[str, int]]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{number} is not JSON ({err.msg}); JSONL needs one object per line") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"{path}:{number} has no string {field!r} field (--text-field)")
            yield text, len(line)


def _parquet_documents(path: Path, field: str) -> Iterator[tuple[str, int]]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001  pyarrow's errors name the problem
        raise ConfigError(f"{path} is not a Parquet file: {err}") from None
    if field not in table.schema_arrow.names:
        raise ConfigError(f"{path} has no column {field!r} (--text-field); its columns: "
                          f"{', '.join(table.schema_arrow.names)}")
    rows, size = max(1, table.metadata.num_rows), _size(path)
    for batch in table.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str):
                yield text, size // rows


def _hf_saved_documents(folder: Path, field: str) -> Iterator[tuple[str, int]]:
    import datasets

    try:
        saved = datasets.load_from_disk(str(folder))
    except Exception as err:  # noqa: BLE001
        raise ConfigError(f"--dataset {folder} does not load with datasets.load_from_disk: {err}") from None
    if isinstance(saved, datasets.DatasetDict):
        split = "train" if "train" in saved else next(iter(saved))
        saved = saved[split]
    if field not in saved.column_names:
        raise ConfigError(f"--dataset {folder} has no column {field!r} (--text-field); its columns: "
                          f"{', '.join(saved.column_names)}")
    rows, size = max(1, len(saved)), _size(folder)
    for batch in saved.select_columns([field]).iter(batch_size=1024):
        for text in batch[field]:
            if isinstance(text, str):
                yield text, size // rows


def documents(source: DataSource) -> Iterator[tuple[str, int]]:
    """(text, bytes of input it took) for every document of the source, in order, up to its limit."""
    read = 0
    limit = source.limit
    for file in source.files():
        if file.is_dir():
            docs = _hf_saved_documents(file, source.text_field)
        elif file.suffix in JSONL_SUFFIXES:
            docs = _jsonl_documents(file, source.text_field)
        elif file.suffix in PARQUET_SUFFIXES:
            docs = _parquet_documents(file, source.text_field)
        else:
            try:
                docs = iter([(file.read_bytes().decode(errors="replace"), _size(file))])
            except OSError as err:
                raise ConfigError(f"cannot read --dataset file {file}: {err.strerror}") from None
        for text, size in docs:
            yield text, size
            read += size
            if limit is not None and read >= limit:
                return


class TokenStore:
    """The tokenized dataset: one flat array of token ids, memory-mapped."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.meta = json.loads((folder / "meta.json").read_text())
        self.tokens = np.memmap(folder / "tokens.bin", dtype=self.meta["dtype"], mode="r")

    @property
    def documents(self) -> int:
        return int(self.meta["documents"])

    def windows(self, seq_len: int) -> int:
        """Samples of ``seq_len + 1`` tokens the store holds (one epoch)."""
        return max(0, (len(self.tokens) - 1) // seq_len)

    def window(self, index: int, seq_len: int) -> np.ndarray:
        start = index * seq_len
        return np.asarray(self.tokens[start:start + seq_len + 1], dtype=np.int64)


def _write_tokens(source: DataSource, tokenizer: Tokenizer, folder: Path, progress: Progress | None) -> dict:
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    total = sum(_size(f) for f in source.files()) or 1
    if source.limit is not None:
        total = min(total, source.limit)
    count = docs = read = 0
    pending: list[int] = []
    last = time.monotonic()
    with open(folder / "tokens.bin", "wb") as out:
        for text, size in documents(source):
            pending.extend(tokenizer.encode(text, add_bos=True, add_eos=True))
            docs += 1
            read += size
            if len(pending) >= WRITE_CHUNK_TOKENS:
                out.write(np.asarray(pending, dtype=dtype).tobytes())
                count += len(pending)
                pending = []
            if progress is not None and time.monotonic() - last >= PROGRESS_EVERY_S:
                progress(min(1.0, read / total), docs, count + len(pending))
                last = time.monotonic()
        out.write(np.asarray(pending, dtype=dtype).tobytes())
        count += len(pending)
    if progress is not None:
        progress(1.0, docs, count)
    meta = {"format": CACHE_FORMAT, "dtype": np.dtype(dtype).name, "tokens": count, "documents": docs,
            "vocab_size": vocab, "source": source.name, "text_field": source.text_field, "max_bytes": source.limit}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def open_tokens(source: DataSource, tokenizer: Tokenizer, tokenizer_id: str, cache_root: Path | None = None,
                progress: Progress | None = None) -> TokenStore:
    """The source tokenized with ``tokenizer`` (``tokenizer_id`` names it): read from its cache, or
    tokenized now (once, whoever else asks at the same time) and cached."""
    root = cache_root or source.default_cache()
    key = hashlib.sha256(f"{source.identity()}|{tokenizer_id}".encode()).hexdigest()[:16]
    folder = root / key
    if (folder / "meta.json").is_file():
        return TokenStore(folder)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{key}.lock", "w")
    except OSError as err:
        raise ConfigError(f"cannot write the token cache in {root} ({err.strerror}); give a writable folder with "
                          "--token-cache") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process tokenizing the same input: wait for it
        if not (folder / "meta.json").is_file():
            staging = root / f".{key}.tmp-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            try:
                meta = _write_tokens(source, tokenizer, staging, progress)
                if meta["documents"] == 0 or meta["tokens"] < 2:
                    raise ConfigError(f"--dataset {source.name} holds no text to train on")
                os.replace(staging, folder)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return TokenStore(folder)
