"""bAbI parsing, the BabiLong and RULER NIAH generators: determinism, fact order, supports,
chunk budgets, context lengths within 2% of the target, disjoint train/dev background."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from qrag.config import DataConfig
from qrag.data import load_samples
from qrag.data.babi import load_babi, parse_babi, task_file
from qrag.data.babilong import generate_babilong
from qrag.data.contexts import SPECIAL
from qrag.data.haystack import Haystack, Measure, clear_cache, split_files
from qrag.data.niah import TASKS, generate_niah
from qrag.data.sample import DataError

BABI_STORY = """1 Mary moved to the bathroom.
2 John went to the hallway.
3 Where is Mary? \tbathroom\t1
4 Daniel went back to the hallway.
5 Mary travelled to the office.
6 Where is Mary? \toffice\t5
1 Sandra got the apple.
2 Sandra went to the garden.
3 Where is the apple? \tgarden\t1 2
"""

WORDS = (
    "river castle forest painter singer city novel window garden harbor lantern meadow orchard "
    "candle violin kettle mirror pebble ribbon saddle"
).split()


def write_background(folder, seed: int, sentences: int = 1500) -> None:
    rng = random.Random(seed)
    lines = []
    for i in range(sentences):
        n = rng.randint(4, 14) if i % 97 else 90  # now and then a sentence longer than a chunk
        words = [rng.choice(WORDS) for _ in range(n)]
        lines.append(" ".join(words).capitalize() + ".")
        if i % 7 == 6:
            lines.append("")  # paragraph break
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"book{seed}.txt").write_text("\n".join(lines))


def write_qa1_data(root: Path) -> Path:
    """A small BabiLong source under ``root``: background books bg/train and bg/dev, and a bAbI
    qa1 train/test file pair under babi/en (for the length-sweep and long-context bench tests)."""
    write_background(root / "bg" / "train", 1, 800)
    write_background(root / "bg" / "dev", 2, 800)
    (root / "babi" / "en").mkdir(parents=True)
    for split in ("train", "test"):
        (root / "babi" / "en" / f"qa1_single-supporting-fact_{split}.txt").write_text(BABI_STORY * 3)
    return root


@pytest.fixture(scope="module")
def tokenizer(tiny_encoder):
    from qrag.model.encoder import load_tokenizer

    return load_tokenizer(tiny_encoder)


@pytest.fixture(scope="module")
def measure(tokenizer):
    clear_cache()
    return Measure.from_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def background(tmp_path_factory):
    root = tmp_path_factory.mktemp("background")
    write_background(root / "train", 1)
    write_background(root / "dev", 2)
    return root


@pytest.fixture(scope="module")
def babi_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("babi")
    (root / "en").mkdir()
    for split in ("train", "test"):
        (root / "en" / f"qa1_single-supporting-fact_{split}.txt").write_text(BABI_STORY)
    return root


def true_tokens(tokenizer, chunks):
    return [len(x) for x in tokenizer(chunks, add_special_tokens=False)["input_ids"]]


# -- bAbI -------------------------------------------------------------------------------------


def test_babi_parser_maps_support_lines_to_fact_indices(tmp_path):
    path = tmp_path / "qa2_x_test.txt"
    path.write_text(BABI_STORY)
    qs = parse_babi(path, "qa2")
    assert [q.answer for q in qs] == ["bathroom", "office", "garden"]
    assert qs[0].facts == ("Mary moved to the bathroom.", "John went to the hallway.")
    assert qs[0].support == (0,)
    # question lines are not facts: line 5 is the 4th fact of the first story
    assert qs[1].facts[qs[1].support[0]] == "Mary travelled to the office."
    assert len(qs[1].facts) == 4
    # a new story starts when the numbering restarts
    assert qs[2].facts == ("Sandra got the apple.", "Sandra went to the garden.") and qs[2].support == (0, 1)


def test_babi_parser_names_file_and_line_of_bad_input(tmp_path):
    path = tmp_path / "qa1_x_test.txt"
    path.write_text("1 Mary moved.\n2 Where is Mary?\tkitchen\t7\n")
    with pytest.raises(DataError, match=r"qa1_x_test.txt: line 2: support line 7"):
        parse_babi(path, "qa1")
    path.write_text("one Mary moved.\n")
    with pytest.raises(DataError, match="line 1"):
        parse_babi(path, "qa1")


def test_real_babi_tasks_and_qa3_fallback(shared_data):
    root = shared_data / "babi" / "tasks_1-20_v1-2"
    for task, n_support in (("qa1", 1), ("qa2", 2), ("qa3", 3), ("qa4", 1), ("qa5", 1)):
        qs = load_babi(root, task, "dev")
        assert len(qs) == 1000 and {len(q.support) for q in qs} == {n_support}
        for q in qs[:50]:
            assert all(0 <= i < len(q.facts) for i in q.support)
    assert task_file(root, "qa3", "train").parent.name == "en"  # en-10k has no qa3 train
    assert task_file(root, "qa2", "train").parent.name == "en-10k"


# -- background text --------------------------------------------------------------------------


def test_background_split_is_disjoint(background, shared_data):
    assert {f.name for f in split_files(background, "train")}.isdisjoint(
        {f.name for f in split_files(background, "dev")}
    )
    novels = shared_data / "gutenberg_novels"
    train, dev = split_files(novels, "train"), split_files(novels, "dev")
    assert train and dev and not {f.name for f in train} & {f.name for f in dev}


def test_haystack_chunks_are_sentence_aligned_and_within_budget(background, measure, tokenizer):
    hay = Haystack.build("t", [(background / "dev" / "book2.txt").read_text()], 24, measure)
    assert hay.additive
    counts = true_tokens(tokenizer, [hay.chunk_text(k) for k in range(hay.n_chunks)])
    assert max(counts) <= 24
    assert counts == hay.chunk_counts.tolist()
    # sentence-aligned: a sentence that fits a chunk is never cut between two chunks
    from qrag.data.chunking import split_sentences

    chunks = [hay.chunk_text(k) for k in range(hay.n_chunks)]
    short = [x for x in split_sentences((background / "dev" / "book2.txt").read_text()) if len(x.split()) < 8]
    assert short and all(any(x in c for c in chunks) for x in short[::25])
    assert all(
        np.array_equal(
            hay.chunk_ids(k), np.asarray(tokenizer(hay.chunk_text(k), add_special_tokens=False)["input_ids"])
        )
        for k in range(0, hay.n_chunks, 50)
    )


# -- BabiLong ---------------------------------------------------------------------------------


def babilong(babi_dir, background, measure, length, n=3, seed=0, split="dev"):
    return list(
        generate_babilong(
            "qa1", split, length, n, measure, seed=seed, budget=32, facts_path=babi_dir, background=background
        )
    )


@pytest.mark.parametrize("length", [256, 1024, 4096, 40000])  # 40000 wraps around the corpus
def test_babilong_length_order_support_and_budget(babi_dir, background, measure, tokenizer, length):
    questions = {q.id: q for q in load_babi(babi_dir, "qa1", "dev")}
    for g in babilong(babi_dir, background, measure, length):
        s = g.sample
        counts = true_tokens(tokenizer, s.chunks)
        assert abs(sum(counts) - length) <= 0.02 * length
        assert sum(counts) == s.meta["context_tokens"]
        assert max(counts) <= 32
        q = questions[s.meta["source_id"]]
        facts = [c for c, r in zip(s.chunks, g.refs) if r == SPECIAL]
        assert facts == list(q.facts)  # every fact, in story order, each its own chunk
        assert [s.chunks[i] for i in s.support] == [q.facts[i] for i in q.support]
        assert s.question == q.question and s.answer == q.answer and s.meta["task"] == "qa1"


def test_babilong_is_deterministic_and_seeded(babi_dir, background, measure):
    a = babilong(babi_dir, background, measure, 1024, seed=3, split="train")
    clear_cache()
    b = babilong(babi_dir, background, measure, 1024, seed=3, split="train")
    c = babilong(babi_dir, background, measure, 1024, seed=4, split="train")
    assert [x.sample.chunks for x in a] == [x.sample.chunks for x in b]
    assert [x.sample.support for x in a] == [x.sample.support for x in b]
    assert [x.sample.chunks for x in a] != [x.sample.chunks for x in c]


def test_dev_is_the_frozen_draw_independent_of_the_seed_and_drawn_per_length(babi_dir, background, measure):
    """Every seed and model is scored on the same dev questions and backgrounds (qrag.data.dev_draw),
    and each length is its own seeded draw of the bAbI test questions."""
    a = babilong(babi_dir, background, measure, 1024, n=6, seed=3)
    b = babilong(babi_dir, background, measure, 1024, n=6, seed=4)
    assert [x.sample.chunks for x in a] == [x.sample.chunks for x in b]
    orders = {
        n: [x.sample.meta["source_id"] for x in babilong(babi_dir, background, measure, n, n=6)]
        for n in (1024, 1100, 1200, 1300)
    }
    assert len({tuple(o) for o in orders.values()}) > 1


def test_babilong_train_and_dev_use_different_books(babi_dir, background, measure):
    dev_text = (background / "dev" / "book2.txt").read_text()
    train_text = (background / "train" / "book1.txt").read_text()
    for split, other in (("train", dev_text), ("dev", train_text)):
        g = babilong(babi_dir, background, measure, 2048, n=1, split=split)[0]
        background_chunks = [c for c, r in zip(g.sample.chunks, g.refs) if r >= 0]
        assert not any(c in other for c in background_chunks[:20])


def test_babilong_facts_longer_than_target_drop_old_facts_or_skip(babi_dir, background, measure):
    g = babilong(babi_dir, background, measure, 12, n=2)
    for item in g:
        assert item.sample.meta["context_tokens"] <= 12
        assert all(0 <= i < len(item.sample.chunks) for i in item.sample.support)
    with pytest.raises(DataError, match="fit in 2 tokens"):
        babilong(babi_dir, background, measure, 2, n=2)


def test_babilong_loader_mixes_tasks(babi_dir, background, tokenizer):
    from qrag.data.chunking import tokenizer_counter

    cfg = DataConfig(
        dataset="babilong",
        path=str(background),
        facts_path=str(babi_dir),
        tasks=["qa1"],
        context_tokens=512,
        samples_per_task=4,
        dev_samples_per_task=2,
        chunk_tokens=32,
    )
    count = tokenizer_counter(tokenizer)
    assert len(load_samples(cfg, "train", count)) == 4
    dev = load_samples(cfg, "dev", count)
    assert len(dev) == 2 and len({s.id for s in dev}) == 2


# -- RULER NIAH -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def essays(tmp_path_factory, background):
    import json

    path = tmp_path_factory.mktemp("essays") / "essays.json"
    path.write_text(json.dumps({"text": (background / "train" / "book1.txt").read_text()}))
    return path


@pytest.mark.parametrize("task", list(TASKS))
def test_niah_tasks(task, measure, tokenizer, essays):
    from qrag.data.niah import TASKS as SPECS

    spec = SPECS[task]
    for length in (4096, 8192):  # RULER's lengths start at 4K (a UUID needle alone is 1/16 of 1K)
        items = list(generate_niah(task, "dev", length, 2, measure, budget=64, essays=essays))
        for g in items:
            s = g.sample
            counts = true_tokens(tokenizer, s.chunks)
            assert abs(sum(counts) - length) <= 0.02 * length
            needles = [c for c, r in zip(s.chunks, g.refs) if r == SPECIAL]
            assert len(needles) == max(spec.keys, spec.queries) * spec.values
            assert len(s.support) == spec.queries * spec.values
            answers = s.meta["answers"]
            assert all(any(a in s.chunks[i] for a in answers) for i in s.support)
            assert all(c.startswith("One of the special magic") for c in (s.chunks[i] for i in s.support))
            # the asked key(s) appear in the question and only in the support chunks
            keys = {c.split(" for ", 1)[1].split(" is: ")[0] for c in (s.chunks[i] for i in s.support)}
            assert all(k in s.question for k in keys)
            others = [c for i, c in enumerate(s.chunks) if i not in s.support]
            assert not any(f" {k} is:" in c for k in keys for c in others)
            if spec.haystack == "needles":
                assert sum(c.startswith("One of the special magic") for c in others) > 10
            else:
                assert max(counts) <= 64
    first = [g.sample for g in generate_niah(task, "dev", 1024, 2, measure, budget=64, essays=essays)]
    again = [g.sample for g in generate_niah(task, "dev", 1024, 2, measure, budget=64, essays=essays)]
    assert [(s.chunks, s.support) for s in first] == [(s.chunks, s.support) for s in again]
    train = [g.sample for g in generate_niah(task, "train", 1024, 2, measure, budget=64, essays=essays)]
    assert [s.answer for s in train] != [s.answer for s in first]


def test_niah_loader_and_bad_task(tokenizer, essays):
    from qrag.data.chunking import tokenizer_counter

    cfg = DataConfig(
        dataset="niah", path=str(essays), tasks=["S1", "MV"], context_tokens=512, samples_per_task=2, chunk_tokens=64
    )
    samples = load_samples(cfg, "dev", tokenizer_counter(tokenizer))
    assert [s.meta["task"] for s in samples] == ["niah_single_1", "niah_multivalue"] * 2
    with pytest.raises(DataError, match="unknown NIAH task"):
        load_samples(DataConfig(dataset="niah", path=str(essays), tasks=["S9"]), "dev", tokenizer_counter(tokenizer))


# -- hard negatives and the validation split ------------------------------------------------------

STORY_WORDS = {
    "mary",
    "john",
    "daniel",
    "sandra",
    "bathroom",
    "hallway",
    "office",
    "garden",
    "apple",
    "moved",
    "travelled",
}


@pytest.fixture(scope="module")
def planted_background(tmp_path_factory):
    """Random-word books whose train book hides 20 sentences (3% of its chunks) that share words with the
    bAbI stories."""
    root = tmp_path_factory.mktemp("planted")
    write_background(root / "train", 11)
    write_background(root / "dev", 12)
    book = root / "train" / "book11.txt"
    lines = book.read_text().split("\n")
    for i in range(20):
        lines.insert(37 * i + 5, "")
        lines.insert(37 * i + 6, "Old Mary moved the candle to the bathroom by the hallway window.")
        lines.insert(37 * i + 7, "")
    book.write_text("\n".join(lines))
    return root


def story_like(chunks) -> int:
    from qrag.data.hard_negatives import words

    return sum(1 for c in chunks if len(words(c) & STORY_WORDS) >= 2)


def test_lexical_index_ranks_chunks_by_idf_weighted_overlap(measure):
    from qrag.data.hard_negatives import LexicalIndex

    docs = ["Alpha beta gamma.", "Beta gamma delta.", "Gamma delta epsilon zeta.", "Eta theta."] * 30 + [
        "Alpha zeta eta."
    ]
    hay = Haystack.build("t", ["\n\n".join(docs)], 6, measure)
    index = LexicalIndex(hay, max_df=1.0)
    top = index.top({"alpha", "zeta"}, 3)
    assert "Alpha zeta eta." in hay.chunk_text(int(top[0]))  # the one chunk with both rare words comes first
    assert all(index.scores({"alpha", "zeta"})[top] > 0)
    assert len(index.top({"nothing"}, 3)) == 0


HASH_SEED_SCRIPT = """
import hashlib, random
from qrag.data.haystack import Haystack, Measure
from qrag.data.hard_negatives import LexicalIndex
rng = random.Random(0)
vocab = ["".join(rng.choice("abcdefghij") for _ in range(6)) for _ in range(400)]  # letters: what words() keeps
docs = [" ".join(rng.choice(vocab) for _ in range(12)) + "." for _ in range(600)]
hay = Haystack.build("t", ["\\n\\n".join(docs)], 24, Measure(lambda texts: [len(t.split()) for t in texts]))
print(hashlib.sha256(LexicalIndex(hay, max_df=1.0).scores(vocab[:200]).tobytes()).hexdigest())
"""


def test_lexical_scores_do_not_depend_on_the_string_hash_seed():
    """A run resumed in a new process must draw the same hard negatives: the idf sums are added in
    one order, not in a set's (which changes with PYTHONHASHSEED and moves the last bits)."""
    import os
    import subprocess
    import sys

    outs = set()
    for seed in ("1", "2", "3"):
        env = {
            **os.environ,
            "PYTHONHASHSEED": seed,
            "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "platform"),
        }
        outs.add(
            subprocess.run(
                [sys.executable, "-c", HASH_SEED_SCRIPT], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
    assert len(outs) == 1, outs


@pytest.mark.parametrize("length", [512, 2048])
def test_hard_negatives_bring_story_like_background_into_training_contexts(
    babi_dir, planted_background, measure, tokenizer, length
):
    def make(k):
        clear_cache()
        return list(
            generate_babilong(
                "qa1",
                "train",
                length,
                6,
                measure,
                budget=32,
                facts_path=babi_dir,
                background=planted_background,
                hard_negatives=k,
            )
        )

    plain, hard = make(0), make(4)
    questions = {q.id: q for q in load_babi(babi_dir, "qa1", "train")}
    plain_like = sum(story_like([c for c, r in zip(g.sample.chunks, g.refs) if r >= 0]) for g in plain)
    hard_like = sum(story_like([c for c, r in zip(g.sample.chunks, g.refs) if r >= 0]) for g in hard)
    assert hard_like >= 4 * len(hard) > plain_like
    for g in hard:  # still a well-formed context of the target length: every fact in order, no chunk twice
        s = g.sample
        counts = true_tokens(tokenizer, s.chunks)
        assert abs(sum(counts) - length) <= 0.02 * length and sum(counts) == s.meta["context_tokens"]
        q = questions[s.meta["source_id"]]
        assert [c for c, r in zip(s.chunks, g.refs) if r == SPECIAL] == list(q.facts)
        assert [s.chunks[i] for i in s.support] == [q.facts[i] for i in q.support]
        back = g.refs[g.refs >= 0]
        assert len(set(back.tolist())) == len(back)


def test_hard_negatives_only_in_the_train_split(babi_dir, planted_background, measure):
    from qrag.data.babilong import generate_from_config

    cfg = DataConfig(
        dataset="babilong",
        path=str(planted_background),
        facts_path=str(babi_dir),
        tasks=["qa1"],
        context_tokens=1024,
        samples_per_task=4,
        chunk_tokens=32,
        hard_negatives=6,
    )
    clear_cache()
    train = generate_from_config(cfg, "train", measure)
    assert sum(story_like([c for c, r in zip(g.sample.chunks, g.refs) if r >= 0]) for g in train) >= 6 * len(train)
    dev = generate_from_config(cfg, "dev", measure)
    assert story_like(c for g in dev for c, r in zip(g.sample.chunks, g.refs) if r >= 0) == 0


def test_val_split_is_held_out_questions_in_held_out_books(
    babi_dir, planted_background, measure, tmp_path, shared_data, capsys
):
    from qrag.data.splits import in_validation

    novels = shared_data / "gutenberg_novels"
    train, val, dev = (split_files(novels, s) for s in ("train", "val", "dev"))
    names = [{f.name for f in x} for x in (train, val, dev)]
    assert len(val) == 5 and not (names[0] & names[1] or names[1] & names[2] or names[0] & names[2])
    assert max(f.name for f in train) < min(f.name for f in val)  # the last books: training reads the first ones
    assert split_files(planted_background, "val") == split_files(
        planted_background, "train"
    )  # no val/: the training books
    assert "no validation background" in capsys.readouterr().err
    small = tmp_path / "small"  # a gutenberg_novels layout too small to carve: train keeps its books
    write_background(small / "small_collection_british_fiction", 31)
    write_background(small / "100_english_novels_pre1881", 32)
    assert (
        [f.name for f in split_files(small, "train")] == ["book31.txt"] == [f.name for f in split_files(small, "val")]
    )
    root = tmp_path / "books"
    for split, seed in (("train", 21), ("val", 22), ("dev", 23)):
        write_background(root / split, seed)
    assert [f.name for f in split_files(root, "val")] == ["book22.txt"]
    # The val split: only questions that data.val_fraction holds out, hidden in the val books.
    with pytest.raises(DataError, match="no validation questions"):
        next(generate_babilong("qa1", "val", 512, 1, measure, budget=32, facts_path=babi_dir, background=root))
    held = [q for q in load_babi(babi_dir, "qa1", "train") if in_validation(q.story, 0.9)]  # held out by story
    assert held, "the test story needs a held-out question at val_fraction 0.9"
    val_items = list(
        generate_babilong(
            "qa1", "val", 512, 3, measure, budget=32, facts_path=babi_dir, background=root, val_fraction=0.9
        )
    )
    assert {g.sample.meta["source_id"] for g in val_items} <= {q.id for q in held}
    val_text = (root / "val" / "book22.txt").read_text()
    firsts = [c.split(".")[0] for g in val_items for c, r in zip(g.sample.chunks, g.refs) if r >= 0]
    assert firsts and all(f in val_text for f in firsts)
    assert all(g.haystack.name.startswith("books-val") for g in val_items)


# -- renamed bAbI stories -----------------------------------------------------------------------


def where_is(facts, person: str) -> str | None:
    """qa1's rule: the place of a person's last move."""
    place = None
    for fact in facts:
        words = fact.rstrip(".").split()
        if words[0] == person:
            place = words[-1]
    return place


def test_renamed_stories_keep_their_logic_and_answers(shared_data):
    """Every renamed qa1 question is still answered by its story (names swapped the same way in
    facts, question and answer), and a renaming is a bijection within each kind of name."""
    from qrag.data.babi_names import Renamer

    questions = load_babi(shared_data / "babi" / "tasks_1-20_v1-2", "qa1", "train")[:300]
    renamer = Renamer(questions)
    rng = np.random.default_rng(0)
    changed = 0
    for q in questions:
        mapping = renamer.draw(rng)
        r = renamer.rename(q, mapping)
        assert sorted(mapping) == sorted(mapping.values())  # a permutation
        assert where_is(r.facts, r.question.split()[-1].rstrip("?")) == r.answer
        assert r.support == q.support and len(r.facts) == len(q.facts)
        inverse = {v: k for k, v in mapping.items()}
        assert renamer.rename(r, inverse) == q
        changed += r != q
    assert changed > 250  # almost every draw is a new story


def test_renamer_keeps_to_the_names_a_task_uses(shared_data):
    from qrag.data.babi_names import Renamer

    root = shared_data / "babi" / "tasks_1-20_v1-2"
    people = {"qa3": {"Daniel", "John", "Mary", "Sandra"}, "qa5": {"Bill", "Fred", "Jeff", "Mary"}}
    for task, names in people.items():
        renamer = Renamer(load_babi(root, task, "train"))
        assert set(renamer.kinds[0]) == names
        mapping = renamer.draw(np.random.default_rng(1))
        assert {mapping[n] for n in names} == names
    assert Renamer(load_babi(root, "qa4", "train")).kinds == [
        ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")
    ]


def test_rename_entities_renames_train_samples_only(babi_dir, background, measure):
    from qrag.data.babilong import generate_from_config

    cfg = DataConfig(
        dataset="babilong",
        path=str(background),
        facts_path=str(babi_dir),
        tasks=["qa1"],
        context_tokens=512,
        samples_per_task=12,
        chunk_tokens=32,
    )
    originals = {q.id: q for split in ("train", "dev") for q in load_babi(babi_dir, "qa1", split)}

    def stories(split, rename):
        cfg.rename_entities = rename
        return [
            (g.sample.question, tuple(c for c, r in zip(g.sample.chunks, g.refs) if r == SPECIAL), g.sample.answer)
            for g in generate_from_config(cfg, split, measure)
        ]

    plain = set(stories("train", False))
    assert plain <= {(q.question, q.facts, q.answer) for q in originals.values()}
    renamed = stories("train", True)
    assert len(set(renamed) - plain) >= 3  # new stories
    assert stories("dev", True) == stories("dev", False)


# -- NIAH near-miss needles ---------------------------------------------------------------------


def test_near_miss_keys_differ_a_little():
    import uuid as uuidlib

    from qrag.data.niah import ADJECTIVES, NOUNS, draw_keys, near_miss

    rng = np.random.default_rng(0)
    for key in draw_keys(rng, "uuids", 50, asked=True):
        other = near_miss(rng, key, "uuids")
        changed = sum(a != b for a, b in zip(key, other))
        assert 2 <= changed <= 8 and len(other) == len(key)
        assert uuidlib.UUID(other).version == 4  # still a valid version-4 uuid
    for key in draw_keys(rng, "words", 50, asked=True):
        other = near_miss(rng, key, "words")
        a, n = key.split("-", 1)
        b, m = other.split("-", 1)
        assert other != key and (a == b) != (n == m) and b in ADJECTIVES and m in NOUNS


@pytest.mark.parametrize("task", ["niah_multikey_3", "niah_multikey_2"])
def test_near_miss_needles_only_in_train_and_never_the_answer(task, measure, tokenizer, essays):
    from qrag.data.niah import generate_from_config

    cfg = DataConfig(
        dataset="niah",
        path=str(essays),
        tasks=[task],
        context_tokens=4096,
        samples_per_task=3,
        chunk_tokens=64,
        hard_negatives=6,
    )
    for g in generate_from_config(cfg, "train", measure):
        s = g.sample
        asked = [c.split(" for ", 1)[1].split(" is: ")[0] for c in (s.chunks[i] for i in s.support)]
        inserted = [
            c.split(" for ", 1)[1].split(" is: ")[0]
            for i, (c, r) in enumerate(zip(s.chunks, g.refs))
            if r == SPECIAL and i not in s.support
        ]

        def close(key, k):  # a uuid a few digits away, or a word key sharing its adjective or its noun
            if len(k) == 36:
                return len(key) == 36 and sum(x != y for x, y in zip(key, k)) <= 8
            return bool(set(key.split("-", 1)) & set(k.split("-", 1)))

        near = [key for key in inserted if key not in asked and any(close(key, k) for k in asked)]
        assert len(near) >= 5 and s.meta["near_misses"] == 6
        assert abs(sum(true_tokens(tokenizer, s.chunks)) - 4096) <= 0.02 * 4096  # they take the background's room
        assert all(
            a in s.answer for c in (s.chunks[i] for i in s.support) for a in [c.rsplit(" is: ", 1)[1].rstrip(".")]
        )
    for g in generate_from_config(cfg, "dev", measure):
        assert "near_misses" not in g.sample.meta


@pytest.mark.parametrize("task", ["niah_multiquery", "niah_single_2", "niah_single_1"])
def test_near_misses_only_where_the_haystack_is_needles(task, measure, essays):
    """A near miss is what a long needle haystack holds; the essay and noise tasks never see one
    (with them, niah_multiquery lost every validation question at 1M)."""
    from qrag.data.niah import generate_from_config, near_misses_for

    cfg = DataConfig(
        dataset="niah",
        path=str(essays),
        tasks=[task],
        context_tokens=2048,
        samples_per_task=2,
        chunk_tokens=64,
        hard_negatives=6,
    )
    assert near_misses_for(cfg, "train", task) == 0
    assert near_misses_for(cfg, "train", "mk3") == 6 and near_misses_for(cfg, "dev", "mk3") == 0
    for g in generate_from_config(cfg, "train", measure):
        assert "near_misses" not in g.sample.meta
        assert g.sample.meta["needles"] == {"niah_multiquery": 4}.get(task, 1)
