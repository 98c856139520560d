"""Issue 32, the shards' memory budget: on by default, sized from the machine, and reserved by a
load before it reads anything, so two loads at once never pass it together."""

from __future__ import annotations

import threading

import pytest
import torch

from qrag.index.holder import ShardHolder, machine_budget
from qrag.index.local import LocalIndex
from qrag.index.store import CorpusStore
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from qrag.serving.service import local_service

from test_index import make_documents
from test_service_api import serve_cfg


@pytest.fixture(scope="module")
def model(tiny_encoder):
    return load_embedding_model(resolve_source(None, tiny_encoder), "cpu", positions="relative")


def test_the_shard_budget_is_on_by_default_and_sized_from_the_machine(model, tmp_path):
    service = local_service(serve_cfg(tmp_path), model)  # no shard_memory_bytes given
    budgets = [s.holder.memory_bytes for s in service.holders]
    expected = machine_budget(torch.device("cpu"), 0.5, len(budgets))
    assert all(b is not None and 0.5 * expected < b < 2 * expected for b in budgets), (budgets, expected)
    assert local_service(serve_cfg(tmp_path, shard_memory_fraction=0.0), model).holders[0].holder.memory_bytes is None
    assert local_service(serve_cfg(tmp_path, shard_memory_bytes=12345), model).holders[0].holder.memory_bytes == 12345


def test_concurrent_loads_reserve_their_memory_before_they_load(model, tmp_path):
    store = CorpusStore(tmp_path)
    index = LocalIndex(store, model)
    for name in ("a", "b"):
        index.create(name, chunk_tokens=24, shards=1)
        index.add_documents(name, make_documents(4, seed=ord(name)))
    one = ShardHolder(store, 0, 1, torch.device("cpu")).ensure("a", store.read("a").uid, 1).nbytes()
    holder = ShardHolder(store, 0, 1, torch.device("cpu"), memory_bytes=int(1.5 * one))  # room for one of them
    release, entered = threading.Event(), {"a": threading.Event(), "b": threading.Event()}
    real = store.read_segment

    def stalled(m, shard, batch):
        entered[m.name].set()
        if m.name == "a":
            release.wait(30)
        return real(m, shard, batch)

    store.read_segment = stalled
    loads = [threading.Thread(target=holder.ensure, args=(name, store.read(name).uid, 1)) for name in ("a", "b")]
    loads[0].start()
    assert entered["a"].wait(10)
    loads[1].start()
    assert not entered["b"].wait(1.0), "b started loading while a's load held the room"
    release.set()
    for t in loads:
        t.join(30)
    assert list(holder.corpora) == ["b"] and holder.evictions == 1 and holder.nbytes() <= 1.5 * one
    assert holder.stats()["reserved_bytes"] == 0


def test_writes_check_the_machine_sized_budget_before_embedding(model, tmp_path):
    """Without shard_memory_bytes, a create that would not fit the holders' machine-sized budget
    is refused (507) before any embedding, as with a configured budget."""
    import asyncio

    from qrag.serving.errors import ServiceError

    service = local_service(serve_cfg(tmp_path), model)
    for s in service.holders:
        s.holder.memory_bytes = 1000  # as if the machine had almost nothing to spare
    assert service.corpora.shard_budget() == 1000
    docs = [{"id": d.id, "text": d.text} for d in make_documents(3)]
    with pytest.raises(ServiceError) as err:
        asyncio.run(service.create("books", docs))
    assert err.value.status == 507 and "shard_memory_bytes" in err.value.message
    assert "books" not in service.store.names()
