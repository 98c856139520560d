import gzip
import json

import pytest

from qrag.config import DataConfig
from qrag.data import DataError, load_samples
from qrag.data.chunking import cap_paragraphs, pack_sentences, split_sentences
from qrag.data.hotpotqa import load_hotpotqa
from qrag.data.splits import dev_score, in_split

from conftest import make_hotpot_records


def words(texts):
    return [len(t.split()) for t in texts]


def load(path, split="all", budget=220, limit=None):
    return load_hotpotqa(path, split=split, dev_fraction=0.2, budget=budget, count=words, limit=limit)


def test_one_chunk_per_paragraph_and_support(tmp_path):
    recs = make_hotpot_records(3)
    path = tmp_path / "h.json"
    path.write_text(json.dumps(recs))
    samples = load(path)
    assert len(samples) == 3
    for rec, s in zip(recs, samples):
        assert len(s.chunks) == len(rec["context"])
        titles = [t for t, _ in rec["context"]]
        gold = sorted({titles.index(t) for t, _ in rec["supporting_facts"]})
        assert s.support == gold
        assert s.chunks[0].startswith(titles[0] + ":")


def test_gz_and_glob(tmp_path):
    recs = make_hotpot_records(4)
    with gzip.open(tmp_path / "a.json.gz", "wt") as fh:
        json.dump(recs[:2], fh)
    (tmp_path / "b.json").write_text(json.dumps(recs[2:]))
    assert [s.id for s in load(str(tmp_path / "*.json*"))] == [r["_id"] for r in recs]


def test_budget_keeps_whole_sentences():
    paras = [("T", [" one two three.", " four five six.", " seven eight nine."])]
    assert cap_paragraphs(paras, 7, words) == ["T: one two three. four five six."]
    # A first sentence longer than the budget is kept whole (the encoder truncates it).
    assert cap_paragraphs([("T", [" a b c d e f g h i j."])], 3, words) == ["T: a b c d e f g h i j."]


def test_split_is_deterministic_disjoint_and_near_ratio():
    ids = [f"id{i}" for i in range(5000)]
    dev = [i for i in ids if in_split(i, "dev", 0.2)]
    train = [i for i in ids if in_split(i, "train", 0.2)]
    assert set(dev).isdisjoint(train) and len(dev) + len(train) == len(ids)
    assert 0.18 < len(dev) / len(ids) < 0.22
    assert dev_score("abc") == dev_score("abc")


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda r: r.pop("context"), "no context paragraphs"),
        (lambda r: r.__setitem__("context", []), "no context paragraphs"),
        (
            lambda r: r["supporting_facts"].append(["Nowhere", 0]),
            r"supporting fact \['Nowhere', 0\] points to no context",
        ),
        (lambda r: r["supporting_facts"].append([r["context"][0][0], 99]), "points to no context sentence"),
        (lambda r: r.pop("question"), "missing or empty field 'question'"),
        (lambda r: r.__setitem__("context", [["t", "not a list"]]), r"context\[0\] is not \[title"),
    ],
)
def test_bad_records_name_file_and_record(tmp_path, mutate, message):
    recs = make_hotpot_records(3)
    mutate(recs[1])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(recs))
    with pytest.raises(DataError, match=message) as err:
        load(path)
    assert "bad.json: record 1" in str(err.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load(tmp_path / "nope.json")
    with pytest.raises(DataError, match="matches no file"):
        load(str(tmp_path / "*.nothing"))
    broken = tmp_path / "broken.json"
    broken.write_text('[{"_id": "x",')
    with pytest.raises(DataError, match=r"broken.json: malformed JSON at line 1"):
        load(broken)


def test_unknown_dataset():
    with pytest.raises(DataError, match="unknown dataset 'nope'"):
        load_samples(DataConfig(dataset="nope"), "train", words)


def test_shipped_subset_loads_whole(shared_data):
    cfg = DataConfig()
    train = load_samples(cfg, "train", words)
    dev = load_samples(cfg, "dev", words)
    assert len(train) + len(dev) == 1368  # nothing dropped
    assert 0.15 < len(dev) / 1368 < 0.25
    assert all(1 <= len(s.support) <= len(s.chunks) for s in train + dev)
    assert {s.id for s in train}.isdisjoint(s.id for s in dev)


def test_sentence_tools():
    assert split_sentences("Mary went home. John ran! Did he?  Yes.\n\nNew para.") == [
        "Mary went home.",
        "John ran!",
        "Did he?",
        "Yes.",
        "New para.",
    ]
    # closing quotes and brackets stay with their sentence (a bug once dropped them)
    assert split_sentences('He said "Go home!" Then (he left.) Why?') == [
        'He said "Go home!"',
        "Then (he left.)",
        "Why?",
    ]
    assert "".join(split_sentences('"Stop!" It ended.')).replace(" ", "") == '"Stop!"Itended.'
    assert pack_sentences(["a", "b", "c", "d"], [3, 3, 5, 1], 6) == [(0, 2), (2, 4)]
    assert pack_sentences(["long"], [99], 6) == [(0, 1)]
