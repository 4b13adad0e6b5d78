"""A tokenizer and a dataset made from text on this machine, for the tests and the benchmarks:
a user's Hugging Face tokenizer folder and JSONL data, with nothing downloaded.

The text is the Python standard library's own sources; the tokenizer a byte-level BPE trained on
them with the ``tokenizers`` library (as GPT-2's and Llama 3's are built), saved as
``tokenizer.json`` and ``tokenizer_config.json`` with BOS and EOS tokens, which torchtitan's
``HuggingFaceTokenizer`` loads like any downloaded one.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.dataset import DataSource

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def stdlib_texts(count: int, skip: int = 0) -> list[Path]:
    """``count`` of the standard library's source files (of about 1,800), after the first ``skip``."""
    return DataSource().files()[skip:skip + count]


def make_tokenizer(folder: Path, vocab_size: int = 1024, files: int = 60) -> Path:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on ``files`` standard-library
    files; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(f) for f in stdlib_texts(files)], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}))
    return folder


def make_jsonl(path: Path, files: int = 40, skip: int = 60, field: str = "text") -> Path:
    """A JSONL dataset: one standard-library file per line (other files than the tokenizer's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for f in stdlib_texts(files, skip):
            out.write(json.dumps({field: f.read_text(errors="replace"), "source": f.name}) + "\n")
    return path
