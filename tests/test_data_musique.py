"""MuSiQue and 2WikiMultihopQA loaders: the shipped files, synthetic records, bad input."""

from __future__ import annotations

import gzip
import json
import logging

import pytest

from qrag.config import DataConfig
from qrag.data import DataError, load_samples


@pytest.fixture(scope="module")
def count():
    from qrag.data.chunking import tokenizer_counter
    from qrag.model.encoder import bundled_minilm_dir, load_tokenizer

    return tokenizer_counter(load_tokenizer(str(bundled_minilm_dir())))


def musique_record(i: int, supporting=(2, 7), n: int = 20, **extra) -> dict:
    paragraphs = [
        {
            "idx": j,
            "title": f"Title {i}-{j}",
            "paragraph_text": f"Sentence one of {j}. Sentence two of {j}.",
            "is_supporting": j in supporting,
        }
        for j in range(n)
    ]
    return {
        "id": f"2hop__{i}",
        "question": f"Question {i}?",
        "answer": f"Answer {i}",
        "answer_aliases": [f"Alias {i}"],
        "answerable": True,
        "paragraphs": paragraphs,
        "question_decomposition": [],
        **extra,
    }


def write_jsonl(path, records, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


def test_shipped_musique_files(shared_data, count, monkeypatch):
    monkeypatch.setenv("QRAG_DATA_DIR", str(shared_data))
    cfg = DataConfig(dataset="musique", chunk_tokens=110)
    train, dev, both = (load_samples(cfg, split, count) for split in ("train", "dev", "all"))
    assert (len(train), len(dev), len(both)) == (150, 100, 250)  # file-based split of the default files
    assert not {s.id for s in train} & {s.id for s in dev}
    raw = [
        json.loads(line)
        for line in gzip.open(shared_data / "musique" / "musique_ans_v1.0.migres100_split_unstated.jsonl.gz", "rt")
    ]
    for sample, record in zip(dev, raw):
        assert sample.id == record["id"] and len(sample.chunks) == 20
        assert sample.support == [p["idx"] for p in record["paragraphs"] if p["is_supporting"]]
        assert sample.meta["answer_aliases"][0] == record["answer"] and set(record["answer_aliases"]) <= set(
            sample.meta["answer_aliases"]
        )
        assert sample.meta["passages"][3].endswith(record["paragraphs"][3]["paragraph_text"].strip())
    # Chunks are "title: sentences" capped at the budget (a single over-long first sentence aside).
    from qrag.data.chunking import split_sentences

    chunks = [(c, t, p) for s, r in zip(dev, raw) for c, t, p in zip(s.chunks, s.meta["titles"], r["paragraphs"])]
    for (chunk, title, para), n in zip(chunks, count([c for c, _, _ in chunks])):
        if n > 112:  # over budget only when the first sentence alone does not fit; then it stands alone
            assert chunk == f"{title}: {split_sentences(para['paragraph_text'])[0]}"
    assert sum(len(p) > len(c) for s in dev for p, c in zip(s.meta["passages"], s.chunks)) > 100  # many were capped
    hops = [len(s.support) for s in both]
    assert min(hops) == 2 and max(hops) == 4


def test_musique_explicit_path_splits_by_id_hash(tmp_path, count):
    path = write_jsonl(tmp_path / "m.jsonl.gz", [musique_record(i) for i in range(40)], gz=True)
    cfg = DataConfig(dataset="musique", path=str(path), chunk_tokens=110, dev_fraction=0.25)
    train, dev = load_samples(cfg, "train", count), load_samples(cfg, "dev", count)
    assert len(train) + len(dev) == 40 and 0 < len(dev) < 20
    s = train[0]
    assert s.support == [2, 7] and s.chunks[2].startswith(f"Title {s.id.split('__')[1]}-2: Sentence one")
    assert s.answer == s.meta["answer_aliases"][0] and len(s.meta["answer_aliases"]) == 2


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda r: r.pop("question"), "missing or empty field 'question'"),
        (lambda r: r.update(answerable=False), "answerable"),
        (lambda r: [p.update(is_supporting=False) for p in r["paragraphs"]], "no paragraph has is_supporting"),
        (lambda r: r["paragraphs"][4].update(idx=9), "paragraphs[4] has idx 9"),
        (lambda r: r["paragraphs"][1].pop("paragraph_text"), "paragraphs[1] needs string fields"),
        (lambda r: r.update(answer_aliases="x"), "answer_aliases"),
        (lambda r: r.update(answer=""), "missing or empty field 'answer'"),
    ],
)
def test_musique_bad_records_name_file_and_line(tmp_path, count, mutate, message):
    records = [musique_record(i) for i in range(3)]
    mutate(records[1])
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(DataError) as err:
        load_samples(DataConfig(dataset="musique", path=str(path), dev_fraction=0.0), "train", count)
    assert str(path) in str(err.value) and "line 2" in str(err.value) and message in str(err.value)


def test_musique_malformed_json_line(tmp_path, count):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(musique_record(0)) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl: line 2: malformed JSON"):
        load_samples(DataConfig(dataset="musique", path=str(path), dev_fraction=0.0), "train", count)


def test_shipped_2wiki_skips_only_records_without_context(shared_data, count, monkeypatch, caplog):
    monkeypatch.setenv("QRAG_DATA_DIR", str(shared_data))
    raw = [
        json.loads(line)
        for line in gzip.open(
            shared_data / "2wikimultihopqa" / "AdelWang_MIGRES_2wikimultihopqa_wikihop200.jsonl.gz", "rt"
        )
    ]
    no_context = [r["_id"] for r in raw if "context" not in r]
    with caplog.at_level(logging.WARNING, logger="qrag.data.twowiki"):
        samples = load_samples(DataConfig(dataset="2wiki"), "all", count)
    assert len(samples) == 200 - len(no_context) == 164
    [warning] = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert "skipped 36 record(s)" in warning.getMessage() and all(rid in warning.getMessage() for rid in no_context)
    s = samples[0]
    assert s.question.startswith("Which film") and s.answer == "Free Guy" and len(s.chunks) == 10
    titles = [t for t, _ in raw[0]["context"]]
    assert {titles[i] for i in s.support} == {t for t, _ in raw[0]["supporting_facts"]}


def test_2wiki_bad_record_is_an_error_not_a_skip(tmp_path, count):
    good = {
        "_id": "a1",
        "question": "Q?",
        "answer": "A",
        "type": "comparison",
        "context": [["T1", ["s1."]], ["T2", ["s2."]]],
        "supporting_facts": [["T1", 0]],
    }
    bad = {**good, "_id": "a2", "supporting_facts": [["Nowhere", 0]]}
    empty = {**good, "_id": "a3", "context": []}
    path = write_jsonl(tmp_path / "w.jsonl", [good, bad])
    with pytest.raises(DataError, match=r"w.jsonl: line 2 \(_id=a2\).*points to no context"):
        load_samples(DataConfig(dataset="2wiki", path=str(path), dev_fraction=0.0), "train", count)
    path = write_jsonl(tmp_path / "e.jsonl", [good, empty])
    with pytest.raises(DataError, match="line 2.*no context paragraphs"):
        load_samples(DataConfig(dataset="2wiki", path=str(path), dev_fraction=0.0), "train", count)
    # A JSON list works too.
    listed = tmp_path / "w.json"
    listed.write_text(json.dumps([good]))
    [s] = load_samples(DataConfig(dataset="2wiki", path=str(listed), dev_fraction=0.0), "train", count)
    assert s.support == [0] and s.chunks[0] == "T1: s1."
