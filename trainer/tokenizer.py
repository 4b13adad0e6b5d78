"""The tokenizer a job trains with: torchtitan's own, built from its config.

A Hugging Face assets folder (``tokenizer.json``, ``tokenizer_config.json``) goes through
torchtitan's :class:`~torchtitan.components.tokenizer.HuggingFaceTokenizer`. The zero-download
default is :class:`ByteTokenizer`: every byte of UTF-8 is a token, so it needs no files and no
training, and it plugs into a torchtitan ``Trainer.Config`` like any other tokenizer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer

from trainer.errors import ConfigError

BYTE_VOCAB_SIZE = 256
HF_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
"""What torchtitan's Hugging Face tokenizer loads from a folder, in its order of preference."""


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as tokens (vocabulary 256). A document ends with a newline, its end-of-text."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None):
        super().__init__()
        self.eos_id = ord("\n")
        self.bos_id = None

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        data = text.encode()
        return list(data + b"\n" if add_eos else data)

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE


def build_tokenizer(config: BaseTokenizer.Config, assets: str, named: str) -> BaseTokenizer:
    """The tokenizer of a job's config; a Hugging Face one from the ``assets`` folder, which
    ``named`` says where it came from (``--tokenizer``, or the config)."""
    if isinstance(config, ByteTokenizer.Config):
        return config.build()
    folder = Path(assets)
    if not assets:
        raise ConfigError(f"{named} is not set; give a Hugging Face tokenizer folder (tokenizer.json, "
                          "tokenizer_config.json) with --tokenizer DIR")
    if not folder.is_dir():
        raise ConfigError(f"{named} {assets} is not a folder; give a Hugging Face tokenizer folder (tokenizer.json, "
                          "tokenizer_config.json) with --tokenizer DIR")
    if not any((folder / name).is_file() for name in HF_FILES):
        raise ConfigError(f"--tokenizer {folder} holds no tokenizer.json (nor vocab.json / vocab.txt); give a "
                          "Hugging Face tokenizer folder")
    try:
        return config.build(tokenizer_path=str(folder))
    except Exception as err:  # noqa: BLE001  a broken file: the tokenizers library says what is wrong
        raise ConfigError(f"--tokenizer {folder} does not load: {type(err).__name__}: {err}") from None


def tokenizer_identity(tokenizer: BaseTokenizer) -> str:
    """What decides the tokens of a text: names a token cache. A Hugging Face tokenizer is its
    ``tokenizer.json`` (or vocabulary) and its BOS/EOS settings; the byte tokenizer is itself."""
    if isinstance(tokenizer, HuggingFaceTokenizer):
        digest = hashlib.sha256()
        folder = Path(tokenizer.tokenizer_path)
        for name in (*HF_FILES, "merges.txt", "tokenizer_config.json"):
            if (folder / name).is_file():
                digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
        return f"hf-{digest.hexdigest()[:16]}"
    return type(tokenizer).__name__.lower()
