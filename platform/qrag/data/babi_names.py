"""Consistent renaming of bAbI's people, places and objects: new stories with the same logic.

bAbI draws its stories from a handful of names (4 people, 6 rooms, 3 objects per task), and the
1k version (the only one with qa3 train) has 1,000 stories. A long run sees each story hundreds
of times and learns the stories rather than the rule: at 1M tokens its validation Fact EM falls
while training return climbs. Swapping every name for another of the same kind, the same way in
every fact, the question and the answer, keeps the support and the answer's logic and gives each
training sample a story the learner has not seen. Directions (qa4) stay: "north"/"south" are
bound to each other, a permutation would break the opposite relation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

from qrag.data.babi import BabiQuestion

# Every name of qa1-qa5 by kind (bAbI v1.2 en and en-10k); a task renames among those it uses.
KINDS: dict[str, tuple[str, ...]] = {
    "people": ("Bill", "Daniel", "Fred", "Jeff", "John", "Julie", "Mary", "Sandra"),
    "places": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "objects": ("apple", "football", "milk"),
}
_WORD = re.compile(r"[A-Za-z]+")


class Renamer:
    """Draws a permutation within each kind of name and applies it to a question's story."""

    def __init__(self, questions: Iterable[BabiQuestion]):
        used = {w for q in questions for text in (*q.facts, q.question, q.answer) for w in _WORD.findall(text)}
        # Only the names the task uses: a qa3 story never meets qa5's Fred, neither should a renamed one.
        self.kinds = [
            kind for kind in (tuple(n for n in names if n in used) for names in KINDS.values()) if len(kind) > 1
        ]
        names = sorted({n for k in self.kinds for n in k})
        self._pattern = re.compile(r"\b(" + "|".join(names) + r")\b") if names else None

    def draw(self, rng: np.random.Generator) -> dict[str, str]:
        """One random bijection of each kind onto itself."""
        mapping: dict[str, str] = {}
        for kind in self.kinds:
            mapping.update(zip(kind, (kind[i] for i in rng.permutation(len(kind)))))
        return mapping

    def rename(self, q: BabiQuestion, mapping: dict[str, str]) -> BabiQuestion:
        if self._pattern is None:
            return q
        pattern = self._pattern

        def sub(text: str) -> str:
            return pattern.sub(lambda m: mapping.get(m.group(1), m.group(1)), text)

        return BabiQuestion(
            task=q.task,
            id=q.id,
            facts=tuple(sub(f) for f in q.facts),
            question=sub(q.question),
            answer=sub(q.answer),
            support=q.support,
            story=q.story,
        )
