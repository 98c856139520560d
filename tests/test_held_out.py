"""What is held out stays held out (issue 33): validation is drawn by source story, never by
question; no validation or dev context gets training's hard negatives; the dev draw is frozen.

Planted bugs these catch (each seen failing with it): the validation split ignoring the source
(``validation_key`` returning the sample's own id: held-out bAbI stories leak into train); hard
negatives added to dev and val contexts (every split's books here hold story-like text, so a
context that got them shows it).
"""

from __future__ import annotations

import numpy as np
import pytest

from qrag.config import DataConfig
from qrag.data.babi import load_babi
from qrag.data.babilong import generate_from_config
from qrag.data.haystack import Measure, clear_cache
from qrag.data.sample import Sample
from qrag.data.splits import in_validation, split_validation, validation_key
from test_longctx_data import BABI_STORY, write_background

STORY_SENTENCE = "Old Mary moved the candle to the bathroom by the hallway window."


@pytest.fixture(scope="module")
def measure(tiny_encoder):
    from qrag.model.encoder import load_tokenizer

    clear_cache()
    return Measure.from_tokenizer(load_tokenizer(tiny_encoder))


@pytest.fixture(scope="module")
def babi_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("babi")
    (root / "en").mkdir()
    for split in ("train", "test"):
        (root / "en" / f"qa1_single-supporting-fact_{split}.txt").write_text(BABI_STORY * 6)  # 12 stories, 18 questions
    return root


@pytest.fixture(scope="module")
def books_everywhere(tmp_path_factory):
    """train/, val/ and dev/ books alike: random words with a few story-like sentences in each
    (~1% of the chunks), so hard negatives could be drawn in every split."""
    root = tmp_path_factory.mktemp("books")
    for split, seed in (("train", 41), ("val", 42), ("dev", 43)):
        write_background(root / split, seed)
        book = root / split / f"book{seed}.txt"
        lines = book.read_text().split("\n")
        for i in range(6):
            lines.insert(211 * i + 5, f"\n{STORY_SENTENCE}\n")
        book.write_text("\n".join(lines))
    return root


def story_like(g) -> int:
    return sum(1 for c, r in zip(g.sample.chunks, g.refs) if r >= 0 and "Old Mary moved the candle" in c)


def test_validation_is_held_out_by_source_story():
    """Two questions of one story land on the same side whatever their ids; without a story the
    source record decides, then the sample's own id."""
    samples = [
        Sample(f"q{i}", "q?", ["a", "b"], [0], meta={"story_id": f"story{i // 5}", "source_id": f"src{i}"})
        for i in range(400)
    ]
    train, val = split_validation(samples, 0.3)
    assert train and val
    val_stories = {s.meta["story_id"] for s in val}
    assert not val_stories & {s.meta["story_id"] for s in train}
    assert all(len([s for s in val if s.meta["story_id"] == st]) == 5 for st in val_stories)
    assert validation_key(Sample("x", "q?", ["a"], [0], meta={"source_id": "src"})) == "src"
    assert validation_key(Sample("x", "q?", ["a"], [0])) == "x"


def test_babilong_training_data_holds_no_validation_story(babi_dir, books_everywhere, measure):
    cfg = DataConfig(
        dataset="babilong",
        path=str(books_everywhere),
        facts_path=str(babi_dir),
        tasks=["qa1"],
        context_tokens=512,
        samples_per_task=30,
        chunk_tokens=32,
        val_fraction=0.4,
    )
    items = generate_from_config(cfg, "train", measure)
    train, val = split_validation([g.sample for g in items], cfg.val_fraction)
    held = {q.story for q in load_babi(babi_dir, "qa1", "train") if in_validation(q.story, 0.4)}
    assert val and held and {s.meta["story_id"] for s in val} <= held
    assert not {s.meta["story_id"] for s in train} & held
    val_split = list(generate_from_config(cfg, "val", measure))
    assert {g.sample.meta["story_id"] for g in val_split} <= held


def test_hard_negatives_only_in_training_contexts(babi_dir, books_everywhere, measure):
    """Dev, the val split (validation books) and the validation part of train get no hard
    negatives, though every split's books hold story-like chunks."""
    cfg = DataConfig(
        dataset="babilong",
        path=str(books_everywhere),
        facts_path=str(babi_dir),
        tasks=["qa1"],
        context_tokens=1024,
        samples_per_task=24,
        chunk_tokens=32,
        hard_negatives=6,
        val_fraction=0.4,
        rename_entities=True,
    )
    clear_cache()
    train_part, val_part = [], []
    for g in generate_from_config(cfg, "train", measure):
        (val_part if in_validation(validation_key(g.sample), cfg.val_fraction) else train_part).append(g)
    assert train_part and val_part
    assert np.mean([story_like(g) for g in train_part]) >= 3  # what hard negatives bring
    assert all(g.sample.meta["hard_negatives"] > 0 and g.sample.meta.get("renamed") for g in train_part)
    for name, items in (
        ("val part of train", val_part),
        ("val", generate_from_config(cfg, "val", measure)),
        ("dev", generate_from_config(cfg, "dev", measure)),
    ):
        assert all(g.sample.meta["hard_negatives"] == 0 and not g.sample.meta.get("renamed") for g in items), name
        assert np.mean([story_like(g) for g in items]) < 1, name  # a random window holds ~0.3 of them


def test_niah_near_misses_never_in_held_out_samples(measure):
    from qrag.data.niah import generate_from_config as niah_config

    cfg = DataConfig(
        dataset="niah",
        tasks=["niah_multikey_2"],
        context_tokens=1024,
        samples_per_task=30,
        chunk_tokens=64,
        hard_negatives=4,
        val_fraction=0.3,
    )
    items = niah_config(cfg, "train", measure)
    held = [g for g in items if in_validation(validation_key(g.sample), 0.3)]
    kept = [g for g in items if not in_validation(validation_key(g.sample), 0.3)]
    assert held and kept
    assert all("near_misses" not in g.sample.meta for g in held)
    assert all(g.sample.meta["near_misses"] == 4 for g in kept)
