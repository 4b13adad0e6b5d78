"""A user's text, tokenized once into a cache every rank reads by index (trainer/dataset.py),
through torchtitan's own tokenizer loaded from a folder made here from local text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.local_assets import BOS, EOS, make_jsonl, make_tokenizer
from trainer.dataset import DataSource, documents, open_tokens
from trainer.errors import ConfigError
from trainer.tokenizer import ByteTokenizer, build_tokenizer, tokenizer_identity

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    folder = make_tokenizer(tmp_path_factory.mktemp("assets") / "tokenizer", vocab_size=512)
    return build_tokenizer(HuggingFaceTokenizer.Config(), str(folder), "--tokenizer")


def texts(source: DataSource) -> list[str]:
    return [text for text, _ in documents(source)]


def test_every_source_format_reads_its_documents_in_order(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"body": "first doc"}, {"body": "second doc"}, {"body": "third"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in rows))
    pq.write_table(pa.table({"body": [r["body"] for r in rows], "n": [1, 2, 3]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("plain text file")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "dict"))

    every = ["first doc", "second doc", "third"]
    assert texts(DataSource(tmp_path / "a.jsonl", "body")) == every
    assert texts(DataSource(tmp_path / "b.parquet", "body")) == every
    assert texts(DataSource(tmp_path / "saved", "body")) == every
    assert texts(DataSource(tmp_path / "dict", "body")) == ["first doc"], "a DatasetDict: its train split"
    (tmp_path / "saved").rename(tmp_path / ".hidden")  # a folder of files: hidden ones are not data
    (tmp_path / "dict").rename(tmp_path / ".hidden2")
    assert texts(DataSource(tmp_path, "body")) == [*every, *every, "plain text file"], "a folder: its files, sorted"


def test_the_default_is_the_standard_librarys_sources_up_to_8_mib():
    source = DataSource()
    first = next(iter(documents(source)))[0]
    assert "import" in first or "def " in first
    assert source.limit == 8 * 2**20


@pytest.mark.parametrize("make, field, message", [
    (lambda p: p / "missing.jsonl", "text", "does not exist"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "text", "holds no JSONL, text or Parquet files"),
    (lambda p: (p / "x.jsonl").write_text('{"text": 1}\n') and p / "x.jsonl", "text", "x.jsonl:1 has no string 'text' field"),
    (lambda p: (p / "x.jsonl").write_text("not json\n") and p / "x.jsonl", "text", "x.jsonl:1 is not JSON"),
    (lambda p: (p / "x.jsonl").write_text('{"text": "a"}\n') and p / "x.jsonl", "content", "no string 'content' field"),
])
def test_bad_input_is_one_clear_line(tmp_path, make, field, message):
    with pytest.raises(ConfigError, match=message):
        list(documents(DataSource(make(tmp_path), field)))


def test_a_parquet_file_without_the_column_names_the_ones_it_has(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "d.parquet")
    with pytest.raises(ConfigError, match="has no column 'text' .*its columns: content"):
        list(documents(DataSource(tmp_path / "d.parquet")))


def test_a_dataset_is_tokenized_once_with_bos_and_eos_and_read_back_by_index(tmp_path, hf_tokenizer):
    data = make_jsonl(tmp_path / "train.jsonl", files=3)
    calls = []
    store = open_tokens(DataSource(data), hf_tokenizer, tokenizer_identity(hf_tokenizer),
                        progress=lambda *a: calls.append(a))
    assert store.folder.parent == tmp_path / "train.jsonl.tokens", "the cache lives beside the data"
    assert calls[-1][0] == 1.0 and calls[-1][1] == 3
    first = [json.loads(line)["text"] for line in data.read_text().splitlines()][0]
    expected = hf_tokenizer.encode(first, add_bos=True, add_eos=True)
    assert expected[0] == hf_tokenizer.tokenizer.token_to_id(BOS) and expected[-1] == hf_tokenizer.tokenizer.token_to_id(EOS)
    assert store.tokens[:len(expected)].tolist() == expected
    assert store.documents == 3 and store.tokens.dtype == np.uint16
    window = store.window(2, 64)
    assert window.tolist() == store.tokens[128:193].tolist(), "window w: tokens [w·seq, w·seq + seq + 1)"

    calls.clear()
    again = open_tokens(DataSource(data), hf_tokenizer, tokenizer_identity(hf_tokenizer), progress=lambda *a: calls.append(a))
    assert again.folder == store.folder and calls == [], "the second open reads the cache"
    data.write_text(data.read_text() + json.dumps({"text": "one more"}) + "\n")
    changed = open_tokens(DataSource(data), hf_tokenizer, tokenizer_identity(hf_tokenizer))
    assert changed.folder != store.folder and changed.documents == 4, "changed data: a new cache"


def test_the_byte_tokenizer_needs_no_file_and_ends_a_document_with_a_newline(tmp_path):
    (tmp_path / "a.txt").write_text("héllo")
    tokenizer = ByteTokenizer()
    store = open_tokens(DataSource(tmp_path / "a.txt"), tokenizer, tokenizer_identity(tokenizer))
    assert bytes(store.tokens.tolist()) == "héllo\n".encode()


def test_two_processes_opening_the_same_dataset_tokenize_it_once(tmp_path):
    """Ranks and groups start together: one tokenizes under the lock, the others wait and read."""
    data = tmp_path / "big.txt"
    data.write_text("some text to tokenize\n" * 200_000)
    code = ("import sys, time; from pathlib import Path; from trainer.dataset import DataSource, open_tokens; "
            "from trainer.tokenizer import ByteTokenizer; calls = []; "
            f"s = open_tokens(DataSource(Path({str(data)!r})), ByteTokenizer(), 'bytes', "
            "progress=lambda *a: calls.append(a)); print(len(s.tokens), bool(calls))")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = sorted(p.communicate(timeout=120)[0].split() for p in procs)
    assert outs == [["4400001", "False"], ["4400001", "True"]], outs  # 22 bytes × 200,000 and the end of text
    assert not list(data.with_name("big.txt.tokens").glob(".*.tmp-*")), "no half-written cache left"


def test_an_empty_dataset_and_an_unwritable_cache_are_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no text to train on"):
        open_tokens(DataSource(tmp_path / "empty.jsonl"), ByteTokenizer(), "bytes")
    (tmp_path / "a.txt").write_text("text")
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder should be")
    with pytest.raises(ConfigError, match="cannot write the token cache in .*--token-cache"):
        open_tokens(DataSource(tmp_path / "a.txt"), ByteTokenizer(), "bytes", cache_root=blocked / "cache")


def test_a_broken_tokenizer_folder_says_what_is_wrong(tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    (tmp_path / "tok").mkdir()
    with pytest.raises(ConfigError, match="holds no tokenizer.json"):
        build_tokenizer(HuggingFaceTokenizer.Config(), str(tmp_path / "tok"), "--tokenizer")
    (tmp_path / "tok" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="--tokenizer .* does not load: "):
        build_tokenizer(HuggingFaceTokenizer.Config(), str(tmp_path / "tok"), "--tokenizer")
