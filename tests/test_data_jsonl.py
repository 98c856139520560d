import json

import pytest

from qrag.data import DataError
from qrag.data.jsonl import load_jsonl


def write(tmp_path, rows):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_loads_user_records(tmp_path):
    path = write(
        tmp_path,
        [{"id": "a", "question": "Q?", "chunks": ["x", "y"], "support": [1], "answer": "y", "source": "s"}, ""],
    )
    [s] = load_jsonl(path, split="all", dev_fraction=0.2)
    assert (s.id, s.chunks, s.support, s.answer, s.meta) == ("a", ["x", "y"], [1], "y", {"source": "s"})


@pytest.mark.parametrize(
    "row,message",
    [
        ('{"id": "a", "question": "Q", "chunks": ["x"], "support": [0]', "line 1: malformed JSON"),
        ({"question": "Q", "chunks": ["x"], "support": [0]}, "line 1: missing field 'id'"),
        (
            {"id": "a", "question": "Q", "chunks": ["x"], "support": [3]},
            r"line 1 \(id=a\): support index 3 points outside",
        ),
        ({"id": "a", "question": "Q", "chunks": "x", "support": [0]}, "'chunks' must be a list"),
        ({"id": "a", "question": "Q", "chunks": [], "support": []}, "no context chunks"),
        ({"id": "r7", "question": "Q", "chunks": ["x", "y"], "support": []}, r"line 1 \(id=r7\): empty support"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, row, message):
    path = write(tmp_path, [row])
    with pytest.raises(DataError, match=message) as err:
        load_jsonl(path, split="all", dev_fraction=0.2)
    assert "mine.jsonl" in str(err.value)


def test_empty_support_is_an_error_in_any_split(tmp_path):
    """A record with no support chunk would make every first action a success: it stops loading
    with the record named, even when the record falls in the other split."""
    good = {"id": "a", "question": "Q?", "chunks": ["x", "y"], "support": [0]}
    bad = {"id": "empty-one", "question": "Q?", "chunks": ["x", "y"], "support": []}
    path = write(tmp_path, [good, bad])
    for split in ("train", "dev"):
        with pytest.raises(DataError, match=r"line 2 \(id=empty-one\): empty support"):
            load_jsonl(path, split=split, dev_fraction=0.5)
