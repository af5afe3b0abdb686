"""tools/preprocess_data.py: exact round trips through the dataset, bad lines counted, bad input rejected."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from data_assets import tool, train_small_bpe, varied_corpus

from megatron.data.blended_dataset import build_gpt_datasets
from megatron.data.indexed_dataset import IndexedDataset
from megatron.tokenizer import TokenizerConfig, build_tokenizer

preprocess_data = tool("preprocess_data")


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    return train_small_bpe(str(tmp_path_factory.mktemp("bpe")))


def bpe_args(bpe_files) -> list[str]:
    return [
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", bpe_files["vocab_file"],
        "--merge-file", bpe_files["merge_file"],
        "--no-progress",
    ]  # fmt: skip


def write_jsonl(path, docs, key="text", extra_lines=()):
    with open(path, "wb") as f:
        for d in docs:
            f.write((json.dumps({key: d, "id": 1}) + "\n").encode())
        for line in extra_lines:
            f.write(line)


def test_round_trip_text_to_dataset_and_back(tmp_path, bpe_files, capsys):
    docs = varied_corpus(300, seed=21)
    # two files in a directory plus one named file; small chunks force many work items across 2 workers
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", docs[:100])
    write_jsonl(tmp_path / "in" / "b.jsonl", docs[100:200])
    write_jsonl(tmp_path / "c.jsonl", docs[200:])
    out = str(tmp_path / "out")
    argv = ["--input", str(tmp_path / "in"), str(tmp_path / "c.jsonl"), "--output-prefix", out, "--workers", "2"]
    rc = preprocess_data.main(argv + ["--append-eod", "--chunk-bytes", "4096"] + bpe_args(bpe_files))
    assert rc == 0
    summary = capsys.readouterr().out
    assert "300 documents" in summary and "skipped 0 lines" in summary
    tok = build_tokenizer(TokenizerConfig(vocab_file=bpe_files["vocab_file"], merge_file=bpe_files["merge_file"]))
    ds = IndexedDataset(out + "_text_document")
    assert ds.dtype == np.uint16 and ds.num_documents == 300
    for i, d in enumerate(docs):  # order preserved, every document exact, EOD appended
        assert ds[i][-1] == tok.eod
        assert tok.detokenize(ds[i][:-1]) == d

    # through the GPT dataset: the samples of one epoch, in sample order, spell the documents in epoch order
    seq = 32
    (train, _, _) = build_gpt_datasets(out + "_text_document", split="1", seq_length=seq, seed=0,
                                       num_samples=(1, 0, 0), vocab_size=tok.vocab_size)  # fmt: skip
    spe = train.samples_per_epoch
    (train, _, _) = build_gpt_datasets(out + "_text_document", split="1", seq_length=seq, seed=0,
                                       num_samples=(spe, 0, 0), vocab_size=tok.vocab_size)  # fmt: skip
    row_of = {int(r): k for k, r in enumerate(train.shuffle_index[:spe])}
    stream = [int(train.tokens(row_of[0])[0])]
    for j in range(spe):
        stream += train.tokens(row_of[j])[1:].tolist()
    epoch_docs = [ds[int(s)].tolist() for s in train.document_index[: ds.num_documents]]
    full = [t for d in epoch_docs for t in d]
    assert stream == full[: len(stream)] and len(full) - len(stream) < seq
    texts, cur = [], []
    for t in full:
        if t == tok.eod:
            texts.append(tok.detokenize(cur))
            cur = []
        else:
            cur.append(t)
    assert sorted(texts) == sorted(docs)


def test_bad_lines_are_counted_not_fatal(tmp_path, bpe_files, capsys):
    docs = ["good one", "good two", "good three"]
    bad = [b"\xff\xfe not utf-8\n", b"{broken json\n", b'{"other": "x"}\n', b"\n", b'{"text": 5}\n', b'{"text": ""}\n',
           b"[1, 2]\n"]  # fmt: skip
    write_jsonl(tmp_path / "a.jsonl", docs[:2], extra_lines=bad)
    write_jsonl(tmp_path / "b.jsonl", docs[2:])
    out = str(tmp_path / "o")
    for workers in ("1", "2"):
        argv = [
            "--input",
            str(tmp_path / "a.jsonl"),
            str(tmp_path / "b.jsonl"),
            "--output-prefix",
            out,
            "--workers",
            workers,
        ]
        assert preprocess_data.main(argv + bpe_args(bpe_files)) == 0
        text = capsys.readouterr().out
        assert "3 documents" in text and "skipped 7 line(s)" in text
        for reason in ("1 not UTF-8", "1 malformed JSON", "1 missing key 'text'", "1 blank line",
                       "1 'text' is not a string", "1 empty 'text'", "1 JSON line is not an object"):  # fmt: skip
            assert reason in text
        ds = IndexedDataset(out + "_text_document")
        assert len(ds) == 3


def test_plain_text_and_several_keys(tmp_path, bpe_files):
    (tmp_path / "p.txt").write_text("line one\nline two\n\nline three\n", encoding="utf-8")
    args = preprocess_data.build_parser().parse_args(
        ["--input", str(tmp_path / "p.txt"), "--output-prefix", str(tmp_path / "t")] + bpe_args(bpe_files)
    )
    s = preprocess_data.preprocess(args)
    assert s["documents"] == {"text": 3} and s["skipped"] == {"blank line": 1}
    with open(tmp_path / "k.jsonl", "w") as f:
        f.write(json.dumps({"title": "T1", "body": "B1"}) + "\n")
        f.write(json.dumps({"title": "T2"}) + "\n")
    args = preprocess_data.build_parser().parse_args(
        ["--input", str(tmp_path / "k.jsonl"), "--output-prefix", str(tmp_path / "k"), "--json-keys", "title", "body"]
        + bpe_args(bpe_files)
    )
    s = preprocess_data.preprocess(args)
    assert s["documents"] == {"title": 2, "body": 1} and s["skipped"] == {"missing key 'body'": 1}
    assert len(IndexedDataset(str(tmp_path / "k_title_document"))) == 2
    assert len(IndexedDataset(str(tmp_path / "k_body_document"))) == 1


def test_null_tokenizer_preprocessing(tmp_path):
    write_jsonl(tmp_path / "n.jsonl", ["1 2 3", "4 5"])
    argv = ["--input", str(tmp_path / "n.jsonl"), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "10", "--append-eod", "--no-progress"]  # fmt: skip
    assert preprocess_data.main(argv) == 0
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert ds[0].tolist() == [1, 2, 3, 10] and ds[1].tolist() == [4, 5, 10]


def test_bad_input_exits_2_with_one_line(tmp_path, bpe_files, capsys):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "junk.jsonl").write_bytes(b"\xff\n{x\n")
    (tmp_path / "emptydir").mkdir()
    cases = [
        (["--input", str(tmp_path / "empty.jsonl")], r"no documents found .*\(the input is empty\)"),
        (["--input", str(tmp_path / "junk.jsonl")], r"no documents found .*\(1 not UTF-8, 1 malformed JSON\)"),
        (["--input", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--input", str(tmp_path / "emptydir")], "holds no .jsonl"),
    ]
    for argv, match in cases:
        rc = preprocess_data.main(argv + ["--output-prefix", str(tmp_path / "x")] + bpe_args(bpe_files))
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: ")
        assert re.search(match, err[0]), err[0]
    assert not list(tmp_path.glob("x_*"))  # nothing half-written
    rc = preprocess_data.main(["--input", str(tmp_path / "junk.jsonl"), "--output-prefix", "x", "--tokenizer-type",
                               "GPT2BPETokenizer"])  # fmt: skip
    assert rc == 2 and "--vocab-file and --merge-file" in capsys.readouterr().err
