"""Chunked, tokenised splits as Arrow tables, cached on disk so that no process re-tokenises.

Loading HotpotQA means parsing JSON, counting tokens of every sentence to cap paragraphs, and
tokenising every chunk; the learner and every episode feeder did all of it at each start.
:func:`prepare_split` does it once per (data source, tokenizer, chunking settings) and keeps the
result as a Hugging Face ``datasets`` table (one row per sample: text, support, meta and token
ids), saved under the cache directory and memory-mapped by later starts. Runners take
``.shard()``s of it and decode only their rows.

The cache key covers the tokenizer (a hash of its full serialisation), the token layout, every
data setting that changes the samples (``val_fraction`` does not: the validation part is drawn
afterwards), the data root, the split and the code of ``qrag.data`` and ``qrag.data.tokens``. The
entry also lists the files the load read (size, mtime): a changed or missing file rebuilds it.
Generated long-context datasets (babilong, niah) are not cached: they are drawn per seed and
their meta is not plain JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qrag.config import DataConfig
from qrag.data.tokens import TokenizedSample, TokenLayout, tokenize_samples
from qrag.data import load_samples
from qrag.data.chunking import tokenizer_counter
from qrag.data.paths import data_root, recording_sources
from qrag.data.sample import DataError, Sample
from qrag.data.splits import split_validation

log = logging.getLogger(__name__)

CACHED_DATASETS = frozenset({"hotpotqa", "musique", "2wiki", "jsonl", "mixed"})
FORMAT = 1
# Data settings that do not change a split's samples.
_NOT_IN_KEY = ("val_fraction", "cache_dir")


class PreparedSplit:
    """One split's samples and token arrays: an Arrow table (cached datasets) or plain lists."""

    def __init__(
        self, table: Any = None, samples: list[Sample] | None = None, tokenized: list[TokenizedSample] | None = None
    ):
        self.table = table  # datasets.Dataset, or None for the list form
        self._samples, self._tokenized = samples, tokenized

    def __len__(self) -> int:
        return len(self.table) if self.table is not None else len(self._samples or [])

    def samples(self) -> list[Sample]:
        if self.table is None:
            return list(self._samples or [])
        t = self.table.with_format("arrow")[:]
        columns = {
            name: t.column(name).to_pylist() for name in ("id", "question", "chunks", "support", "answer", "meta")
        }
        return [
            Sample(id=i, question=q, chunks=c, support=s, answer=a, meta=json.loads(m))
            for i, q, c, s, a, m in zip(*columns.values())
        ]

    def tokenized(self) -> list[TokenizedSample]:
        if self.table is None:
            return list(self._tokenized or [])
        t = self.table.with_format("arrow").select_columns(["id", "question_ids", "chunk_ids", "support"])[:]
        questions = _int_lists(t.column("question_ids"))
        chunks = t.column("chunk_ids").combine_chunks()
        bounds = chunks.offsets.to_numpy()  # row -> range of chunk rows
        chunk_arrays = _int_lists(chunks.values)
        supports = _int_lists(t.column("support"), np.int64)
        return [
            TokenizedSample(rid, q, chunk_arrays[bounds[r] : bounds[r + 1]], s)
            for r, (rid, q, s) in enumerate(zip(t.column("id").to_pylist(), questions, supports))
        ]

    def select(self, rows: Sequence[int]) -> PreparedSplit:
        if self.table is not None:
            return PreparedSplit(self.table.select(rows, keep_in_memory=True))
        return PreparedSplit(None, [self._samples[i] for i in rows], [self._tokenized[i] for i in rows])

    def shard(self, num_shards: int, index: int) -> PreparedSplit:
        """Rows ``index``, ``index + num_shards``, ... (``datasets.Dataset.shard``, not contiguous)."""
        if self.table is not None:
            return PreparedSplit(self.table.shard(num_shards, index, contiguous=False, keep_in_memory=True))
        return self.select(range(index, len(self), num_shards))

    def split_validation(self, val_fraction: float) -> tuple[PreparedSplit, PreparedSplit]:
        """(train, validation) parts, drawn exactly as :func:`qrag.data.splits.split_validation` draws them."""
        if self.table is None:
            keys = list(self._samples or [])
        else:
            t = self.table.with_format("arrow").select_columns(["id", "meta"])[:]
            keys = [_Key(i, json.loads(m)) for i, m in zip(t.column("id").to_pylist(), t.column("meta").to_pylist())]
        row = {id(k): r for r, k in enumerate(keys)}
        train, val = split_validation(keys, val_fraction)
        return self.select([row[id(k)] for k in train]), self.select([row[id(k)] for k in val])


@dataclasses.dataclass
class _Key:
    """What the validation draw looks at: the id and the meta (e.g. a generated sample's source_id)."""

    id: str
    meta: dict[str, Any]


def _int_lists(column: Any, dtype: Any = np.int32) -> list[np.ndarray]:
    """A list<int> Arrow column -> one numpy array per row (views of one copied buffer)."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False).astype(dtype, copy=True)  # writable, owned
    return [values[offsets[r] : offsets[r + 1]] for r in range(len(array))]


# ---------------------------------------------------------------------------------------------


def prepare_split(cfg: DataConfig, split: str, tokenizer: Any, layout: TokenLayout) -> PreparedSplit:
    """``split`` of the configured data, chunked and tokenised: from the cache when it holds it."""
    folder = cache_folder(cfg)
    # No cache wanted, or no `datasets` installed (a bare GPU image): plain lists, same samples.
    if cfg.dataset not in CACHED_DATASETS or folder is None or importlib.util.find_spec("datasets") is None:
        samples = load_samples(cfg, split, tokenizer_counter(tokenizer))
        return PreparedSplit(None, samples, _tokenize(samples, cfg, tokenizer, layout))
    key = cache_key(cfg, split, tokenizer, layout) if folder is not None else None
    if folder is not None:
        hit = _load_entry(folder / key)
        if hit is not None:
            return PreparedSplit(hit)
    with recording_sources() as sources:
        samples = load_samples(cfg, split, tokenizer_counter(tokenizer))
    tokenized = _tokenize(samples, cfg, tokenizer, layout)
    try:
        table = _to_table(samples, tokenized)
    except TypeError as exc:  # a meta value that is not plain JSON: keep the lists, skip the cache
        log.warning("data cache skipped for %s/%s: %s", cfg.dataset, split, exc)
        return PreparedSplit(None, samples, tokenized)
    if folder is not None:
        _save_entry(folder, key, table, sorted(sources))
    return PreparedSplit(table)


def _tokenize(samples: Sequence[Sample], cfg: DataConfig, tokenizer: Any, layout: TokenLayout) -> list[TokenizedSample]:
    return tokenize_samples(
        samples, tokenizer, layout, chunk_tokens=cfg.chunk_tokens, question_tokens=cfg.question_tokens
    )


def cache_folder(cfg: DataConfig) -> Path | None:
    """``data.cache_dir``, else ``$QRAG_DATA_CACHE``, else ``$QRAG_CACHE_DIR/data``, else ``~/.cache/qrag/data``;
    None = off."""
    chosen = cfg.cache_dir or os.environ.get("QRAG_DATA_CACHE")
    if chosen is None:
        base = os.environ.get("QRAG_CACHE_DIR")
        chosen = str(Path(base) / "data") if base else str(Path.home() / ".cache" / "qrag" / "data")
    return None if chosen.strip().lower() in ("none", "off", "") else Path(chosen).expanduser()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of everything that decides the ids: the fast tokenizer's full JSON (vocab, normaliser, ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps(
        [type(tokenizer).__name__, tokenizer.all_special_tokens, getattr(tokenizer, "do_lower_case", None)]
    )
    return hashlib.sha256((text + extra).encode("utf-8")).hexdigest()


def _code_fingerprint() -> str:
    here = Path(__file__).resolve().parent
    files = sorted(here.glob("*.py"))  # the loaders and the token layout (data/tokens.py)
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def _absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def cache_key(cfg: DataConfig, split: str, tokenizer: Any, layout: TokenLayout) -> str:
    data = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_IN_KEY}
    data["path"] = _absolute(cfg.path)  # relative paths mean different files in different directories
    try:
        root = str(data_root().resolve())
    except DataError:
        root = None
    fields = {
        "format": FORMAT,
        "split": split,
        "data": data,
        "data_root": root,
        "layout": dataclasses.asdict(layout),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "code": _code_fingerprint(),
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:24]
    return f"{cfg.dataset}-{split}-{digest}"


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _load_entry(entry: Path) -> Any:
    """The cached table, or None when absent, unreadable or built from files that changed since."""
    manifest = entry / "qrag_manifest.json"
    if not manifest.is_file():
        return None
    try:
        import datasets

        info = json.loads(manifest.read_text())
        if any(_stat(path) != stat for path, stat in info["sources"].items()):
            log.info("data cache %s: a source file changed; rebuilding", entry.name)
            return None
        return datasets.load_from_disk(str(entry / "table"))
    except Exception as exc:  # a damaged entry is a miss, never an error
        log.warning("data cache %s unreadable (%s: %s); rebuilding", entry, type(exc).__name__, exc)
        return None


def _save_entry(folder: Path, key: str, table: Any, sources: list[str]) -> None:
    """Write under a temporary name and rename: concurrent writers (runners) never see half an entry."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=folder))
        tmp.chmod(0o755)
        _quietly(table.save_to_disk, str(tmp / "table"))
        manifest = {"key": key, "rows": len(table), "sources": {path: _stat(path) for path in sources}}
        (tmp / "qrag_manifest.json").write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, folder / key)
        except OSError:  # another process wrote the same entry first (or a stale one is there): keep it
            shutil.rmtree(tmp, ignore_errors=True)
            if _load_entry(folder / key) is None:
                shutil.rmtree(folder / key, ignore_errors=True)
    except OSError as exc:
        log.warning("data cache %s not written: %s", folder, exc)


def _quietly(fn: Any, *args: Any) -> Any:
    """Run ``fn`` without datasets' progress bars (one per save would clutter every start)."""
    from datasets.utils import logging as ds_logging

    was_on = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        return fn(*args)
    finally:
        if was_on:
            ds_logging.enable_progress_bar()


def _to_table(samples: Sequence[Sample], tokenized: Sequence[TokenizedSample]) -> Any:
    """Columns built as Arrow arrays from flat numpy buffers (row by row conversion of ~10K small
    arrays would cost as much as the tokenisation it saves)."""
    import datasets
    import pyarrow as pa

    questions = [t.question for t in tokenized]
    chunks = [c for t in tokenized for c in t.chunks]
    columns = {
        "id": pa.array([s.id for s in samples], pa.string()),
        "question": pa.array([s.question for s in samples], pa.string()),
        "chunks": pa.array([s.chunks for s in samples], pa.list_(pa.string())),
        "support": pa.array([list(s.support) for s in samples], pa.list_(pa.int64())),
        "answer": pa.array([s.answer for s in samples], pa.string()),
        "meta": pa.array([json.dumps(s.meta) for s in samples], pa.string()),
        "question_ids": _list_array(questions),
        "chunk_ids": pa.ListArray.from_arrays(_offsets([len(t.chunks) for t in tokenized]), _list_array(chunks)),
    }
    # Our own fingerprint: from_dict would hash the whole table through dill, which disassembles
    # functions on the way (dill.detect prints the bytecode in processes whose stdout it cannot
    # capture, e.g. a Ray Train worker's) and costs as much as the table's bytes.
    digest = hashlib.sha256()
    for name, column in columns.items():
        digest.update(name.encode())
        for buf in column.buffers():
            if buf is not None:
                digest.update(memoryview(buf))
    table = datasets.table.InMemoryTable(pa.Table.from_pydict(columns))
    return datasets.Dataset(table, fingerprint=digest.hexdigest()[:16])


def _offsets(lengths: Sequence[int]) -> Any:
    import pyarrow as pa

    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return pa.array(out)


def _list_array(arrays: Sequence[np.ndarray]) -> Any:
    """list<int32> from numpy arrays, in one copy."""
    import pyarrow as pa

    values = np.concatenate(arrays).astype(np.int32, copy=False) if len(arrays) else np.zeros(0, np.int32)
    return pa.ListArray.from_arrays(_offsets([len(a) for a in arrays]), pa.array(values))
