"""Chunk-embedding corpora: ``store`` (on disk: manifest, batches, segments), ``shards`` (scoring
one shard, FAISS, merging), ``holder`` (what one process holds of every corpus), ``local`` (indexing
and search in one process; the search itself is :mod:`qrag.retrieval.multistep`), and the indexing
paths ``pipeline``, ``lanes``, ``bulk`` (which one when: docs/indexing.md).

The shard hierarchy
-------------------

Chunk g of a corpus of S shards lives in shard g % S (``store``). From one shard up to what the
search driver calls, each layer holds or reaches the one above it and answers with one method::

    class           where                    holds                                   runs in / called by
    ShardIndex      index/shards.py          one shard of one corpus in memory:      any process that holds shards /
                                             vectors on a device, texts, token ids,  CorpusShards, score_shards,
                                             a FAISS index where allowed             ShardsBackend
    CorpusShards    index/shards.py          the shards of one corpus that one       ShardHolder, LocalIndex
                                             process holds, in step with the store
        both: best_chunks(states, selected, n_total, k) -> ShardHits

    ShardHolder     index/holder.py          one process's slots (slot, slot + H,    an Ingress replica (shards in the
                                             ...) of every corpus, loaded lazily     Ingress) or a Shard replica /
                                             within a memory budget                  its client
    clients of a holder (HolderClient, serving/backends.py):
    LocalHolder     serving/backends.py      a ShardHolder of this process           the service (HoldersBackend)
    RemoteHolder    distributed/serving.py   a Shard deployment, over its handle     the service in the Ingress
    Shard           distributed/serving.py   the Serve deployment (Shard0..) around  Serve / RemoteHolder
                                             one ShardHolder
        all: best_chunks(corpus, uid, version, states, selected, n_total, k) -> ShardHits
        (LocalHolder also best_chunks_now: the same, synchronously)

    scoring backends of the search driver (retrieval/multistep.py ScoringBackend):
    HoldersBackend  serving/backends.py      one corpus version over every holder    the service's retrieval requests
                                             client, asked at once                   (through the batcher)
    ShardsBackend   index/local.py           ShardIndex objects the caller holds     LocalIndex (the library),
                                             itself                                  InlineBackend
    InlineBackend   serving/backends.py      an inline context's one shard, held     the service (a request with
                                             for one request                         "context")
        all: score(states, rows, selected, k) -> list[ShardHits] (awaited for the service's
        backends, which add score_now where the work runs in this process);
        retrieval/search.py ContextVectors answers the same over contexts in memory (evaluation).
"""
