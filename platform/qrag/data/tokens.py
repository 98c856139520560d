"""Token arrays for episodes: samples are tokenised once, states are built by concatenation.

A chunk's encoder input is ``[CLS] chunk [SEP]``; a state is ``[CLS] q [SEP] c_i [SEP] c_j [SEP]``
with the selected chunks in document order, i.e. the question's input followed by each selected
chunk's input without its leading ``[CLS]``. No text is re-tokenised while acting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qrag.data.sample import Sample


@dataclass
class TokenizedSample:
    """A sample as the learner and the search see it."""

    id: str
    question: np.ndarray  # [CLS] q [SEP], int32
    chunks: list[np.ndarray]  # [CLS] chunk [SEP] per chunk, document order, int32
    support: np.ndarray  # chunk indices, int64

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)


@dataclass(frozen=True)
class TokenLayout:
    """Special tokens and length caps of one tokenizer."""

    cls_id: int | None
    sep_id: int | None
    pad_id: int
    max_state_tokens: int

    @classmethod
    def from_tokenizer(cls, tokenizer, max_state_tokens: int) -> TokenLayout:
        cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
        sep_id = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (sep_id or 0)
        limit = getattr(tokenizer, "model_max_length", max_state_tokens) or max_state_tokens
        return cls(cls_id, sep_id, int(pad_id), int(min(max_state_tokens, limit)))

    @property
    def n_prefix(self) -> int:
        return 0 if self.cls_id is None else 1

    def wrap(self, ids: Sequence[int]) -> np.ndarray:
        """``ids`` between the special tokens, int32 (one copy, whether ``ids`` is a list or an array)."""
        head = 0 if self.cls_id is None else 1
        out = np.empty(head + len(ids) + (self.sep_id is not None), dtype=np.int32)
        if head:
            out[0] = self.cls_id
        out[head : head + len(ids)] = ids
        if self.sep_id is not None:
            out[-1] = self.sep_id
        return out

    def state(self, question: np.ndarray, chunks: Sequence[np.ndarray]) -> np.ndarray:
        """The state's input ids; ``chunks`` must already be in document order."""
        bodies = [c[self.n_prefix :] for c in chunks]
        total = len(question) + sum(len(b) for b in bodies)
        if total > self.max_state_tokens and bodies:
            # Keep the question whole and give every selected chunk an equal share of the rest,
            # so that no selected chunk disappears from the state.
            share = max(2, (self.max_state_tokens - len(question)) // len(bodies))
            tail = [] if self.sep_id is None else [self.sep_id]
            bodies = [
                b if len(b) <= share else np.concatenate([b[: share - len(tail)], np.asarray(tail, np.int32)])
                for b in bodies
            ]
        return np.concatenate([question, *bodies])[: self.max_state_tokens]


def tokenize_samples(
    samples: Sequence[Sample], tokenizer, layout: TokenLayout, *, chunk_tokens: int, question_tokens: int
) -> list[TokenizedSample]:
    """Tokenise questions and chunks of many samples in a few batched tokenizer calls."""
    questions = [s.question for s in samples]
    q_ids = (
        tokenizer(questions, add_special_tokens=False, truncation=True, max_length=question_tokens)["input_ids"]
        if questions
        else []
    )
    flat = [c for s in samples for c in s.chunks]
    c_ids = (
        tokenizer(flat, add_special_tokens=False, truncation=True, max_length=chunk_tokens)["input_ids"] if flat else []
    )
    out, k = [], 0
    for sample, q in zip(samples, q_ids):
        chunks = [layout.wrap(ids) for ids in c_ids[k : k + len(sample.chunks)]]
        k += len(sample.chunks)
        out.append(TokenizedSample(sample.id, layout.wrap(q), chunks, np.asarray(sample.support, dtype=np.int64)))
    return out
