"""Chunk-embedding corpora: ``store`` (on disk), ``shards`` (scoring one shard, FAISS, merging),
``local`` (indexing and search in one process; the search itself is :mod:`qrag.retrieval.multistep`)."""
