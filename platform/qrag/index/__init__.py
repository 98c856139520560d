"""Chunk-embedding corpora: ``store`` (on disk), ``shards`` (scoring one shard, FAISS, merging),
``multistep`` (the search over shards), ``local`` (indexing and search in one process)."""
