"""Chunking and tokenising documents in worker processes: the CPU stage of bulk indexing.

A worker holds one :class:`qrag.retrieval.embedder.Tokenization` (made by :func:`init_worker`, a
``ProcessPoolExecutor`` initializer) and turns a block of documents into their chunks and token
ids (:func:`prepare_block`), handed back packed (:func:`qrag.data.documents.pack_chunks`: a few
flat objects, cheap to unpickle for the process that feeds the GPU).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence

from qrag.data.documents import Document, pack_chunks

_TOKENIZATION = None


def init_worker(
    tokenizer_dir: str, layout, question_tokens: int = 64, nice: int = 0, parent_pid: int | None = None
) -> None:
    """Load the tokenizer once per worker (``layout``: the model's TokenLayout). With
    ``parent_pid`` (the pool owner's pid) the worker dies with that process (see
    :func:`die_with_parent`)."""
    global _TOKENIZATION
    import torch

    if parent_pid is not None:
        die_with_parent(parent_pid)

    from qrag.model.encoder import load_tokenizer
    from qrag.retrieval.embedder import Tokenization

    torch.set_num_threads(1)  # a worker tokenises; torch's thread pool would only take cores
    if nice:  # below the GPU-feeding process: with every core tokenising, it must not wait for a core
        os.nice(nice)
    _TOKENIZATION = Tokenization(load_tokenizer(tokenizer_dir), layout, question_tokens)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent exits (Linux; elsewhere a no-op).

    A forked pool worker holds its own copy of the pool's queues, so it never sees them close:
    if the pool's owner dies without shutting the pool down (a lane killed by the OOM killer or
    ending in ``os._exit``), its workers would wait on the queue forever. ``parent_pid`` closes
    the race in which the parent died before the signal was armed."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not allowed here: the worker lives on as before
    if os.getppid() != parent_pid:  # the parent was gone before the signal was armed
        os._exit(1)


def tokenization():
    """This worker's Tokenization (:func:`init_worker` made it)."""
    if _TOKENIZATION is None:
        raise RuntimeError("tokenising runs in a worker set up by qrag.index.tokenise_workers.init_worker")
    return _TOKENIZATION


def prepare_block(docs: Sequence[tuple[str, str]], chunk_tokens: int) -> tuple:
    """(id, text) documents -> their chunks in order and the chunks' encoder ids, packed."""
    chunks, ids = tokenization().chunk_documents([Document(i, t) for i, t in docs], chunk_tokens)
    return pack_chunks(chunks, ids)


def char_groups(
    docs: Iterable[Document], min_chars: int, first_groups: int = 0, first_chars: int = 1
) -> Iterator[list[Document]]:
    """Whole documents in input order, in groups of at least ``min_chars`` characters (the last
    may be smaller); the first ``first_groups`` groups of at least ``first_chars`` instead.
    Boundaries depend on the documents alone."""
    if min_chars < 1 or first_chars < 1:
        raise ValueError(f"a group needs at least 1 character, got {min(min_chars, first_chars)}")
    group: list[Document] = []
    size = made = 0
    for doc in docs:
        group.append(doc)
        size += len(doc.text)
        if size >= (first_chars if made < first_groups else min_chars):
            yield group
            group, size = [], 0
            made += 1
    if group:
        yield group


def blocks_of(docs: Sequence[Document], block_chars: int) -> list[list[Document]]:
    """Consecutive documents in blocks of about ``block_chars`` characters (a document longer
    than that is a block of its own): one tokenising job each."""
    return list(char_groups(docs, block_chars))
