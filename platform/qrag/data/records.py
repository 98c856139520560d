"""Reading the input files of a bulk load: which files an input names, their format, how a large
file is cut into parts that read in parallel, and the documents of a file or of one of its parts.

Formats: ``jsonl`` (one ``{"id", "text"}`` object per line; other fields are ignored),
``parquet`` (columns ``id`` and ``text``), ``text`` (one document per file, its id the file name
without .txt/.md/.gz). Inputs are local paths, globs, folders or any fsspec URL. Errors name the
file and the record (line or row; in the parts of a split JSONL file after the first, the line by
its byte offset).

Both indexing paths read through this module: the lanes (:mod:`qrag.index.bulk`) and the Ray Data
pipeline (:mod:`qrag.distributed.bulk_index`); it imports no Ray.
"""

from __future__ import annotations

import glob as globlib
import json
from collections.abc import Iterator, Sequence

from qrag.data.documents import Document, parse_document
from qrag.data.sample import DataError

FORMATS = ("jsonl", "text", "parquet")
SUFFIXES = {
    "jsonl": (".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz", ".json", ".json.gz"),
    "text": (".txt", ".txt.gz", ".md", ".md.gz"),
    "parquet": (".parquet",),
}


def format_of(path: str) -> str | None:
    name = path.lower()
    return next((f for f, ends in SUFFIXES.items() if name.endswith(ends)), None)


def expand_inputs(inputs: Sequence[str], fmt: str = "auto") -> list[tuple[str, str]]:
    """(path or URL, format) of every input file, in a stable order; a clear error for a missing
    file, a glob that matches nothing, or a file whose format cannot be told."""
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    out: list[tuple[str, str]] = []
    for spec in inputs:
        try:
            fs, path = url_to_fs(spec)
        except (ImportError, ValueError) as exc:  # an unknown protocol, a missing fsspec backend
            raise DataError(f"{spec}: cannot open: {exc}") from None
        local = isinstance(fs, LocalFileSystem)
        if globlib.has_magic(path):
            found = sorted(p for p in fs.glob(path) if fs.isfile(p))
            if not found:
                raise DataError(f"{spec}: no file matches")
        elif fs.isdir(path):
            found = sorted(p for p in fs.find(path) if (format_of(p) == fmt if fmt != "auto" else format_of(p)))
            if not found:
                raise DataError(f"{spec}: a folder without {fmt if fmt != 'auto' else 'jsonl, text or parquet'} files")
        elif fs.isfile(path):
            found = [path]
        else:
            raise DataError(f"{spec}: no such file or directory")
        for p in found:
            kind = fmt if fmt != "auto" else format_of(p)
            if kind is None:
                raise DataError(f"{p}: cannot tell the format from the name; pass --format jsonl|text|parquet")
            out.append((p if local else fs.unstrip_protocol(p), kind))
    seen: set[str] = set()
    return [x for x in out if not (x[0] in seen or seen.add(x[0]))]


def text_doc_id(path: str) -> str:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    for end in (".gz", ".txt", ".md"):
        if name.lower().endswith(end):
            name = name[: -len(end)]
    return name


WHOLE = -1  # a part's end: to the end of the file


def plan_parts(files: Sequence[tuple[str, str]], part_bytes: int) -> list[tuple[str, str, int, int]]:
    """(path, format, start, end) of every read task, in corpus order. An uncompressed JSONL file
    over ``part_bytes`` is cut into byte ranges (a range holds the lines that start in it); a
    parquet file over it into runs of row groups of about that size; anything else is one part
    (0, WHOLE). Parts of one file follow each other, so the documents keep their order."""
    import fsspec
    from fsspec.utils import infer_compression

    parts: list[tuple[str, str, int, int]] = []
    for path, fmt in files:
        try:
            fs, local = fsspec.core.url_to_fs(path)
            size = fs.size(local) if fmt in ("jsonl", "parquet") else 0
        except (OSError, ValueError):
            size = 0  # read_records names the problem when the file is read
        if fmt == "jsonl" and size > part_bytes and infer_compression(path) is None:
            parts.extend((path, fmt, start, min(start + part_bytes, size)) for start in range(0, size, part_bytes))
        elif fmt == "parquet" and size > part_bytes:
            parts.extend((path, fmt, g0, g1) for g0, g1 in _row_group_runs(path, part_bytes))
        else:
            parts.append((path, fmt, 0, WHOLE))
    return parts


def _row_group_runs(path: str, part_bytes: int) -> list[tuple[int, int]]:
    """[first, end) row-group ranges of about ``part_bytes`` (uncompressed) each."""
    import fsspec
    import pyarrow.parquet as pq

    try:
        with fsspec.open(path, "rb") as fh:
            md = pq.ParquetFile(fh).metadata
    except Exception:  # noqa: BLE001 - read_records names what is wrong with the file
        return [(0, WHOLE)]
    runs, first, size = [], 0, 0
    for g in range(md.num_row_groups):
        size += md.row_group(g).total_byte_size
        if size >= part_bytes:
            runs.append((first, g + 1))
            first, size = g + 1, 0
    if first < md.num_row_groups or not runs:
        runs.append((first, WHOLE))
    return runs


def _jsonl_lines(path: str, start: int, end: int) -> Iterator[tuple[str, str]]:
    """(record label, line) of a JSONL file, or of the lines that start in [start, end) of an
    uncompressed one (labelled by line number in the first part, by byte offset after it)."""
    import fsspec

    if start == 0 and end == WHOLE:
        with fsspec.open(path, "rt", encoding="utf-8", compression="infer") as fh:
            for lineno, line in enumerate(fh, 1):
                yield f"line {lineno}", line
        return
    with fsspec.open(path, "rb") as fh:
        if start > 0:
            fh.seek(start - 1)
            fh.readline()  # the line holding byte start - 1 started in the part before
        lineno = 0
        while True:
            pos = fh.tell()
            if end != WHOLE and pos >= end:
                return
            raw = fh.readline()
            if not raw:
                return
            lineno += 1
            yield (f"line {lineno}" if start == 0 else f"line at byte {pos}"), raw.decode("utf-8")


def read_records(path: str, fmt: str, start: int = 0, end: int = WHOLE) -> Iterator[tuple[str, Document]]:
    """(record label, document) of one file, or of one part of it (:func:`plan_parts`: a JSONL
    byte range or a parquet row-group range); DataError names the file and the record."""
    import fsspec

    try:
        if fmt == "jsonl":
            for label, line in _jsonl_lines(path, start, end):
                if not line.strip():
                    continue
                at = f"{path}: {label}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{at}: not JSON ({exc.msg} at column {exc.colno})") from None
                yield label, parse_document(rec, at, extra_fields=True)
        elif fmt == "text":
            with fsspec.open(path, "rt", encoding="utf-8", compression="infer") as fh:
                text = fh.read().lstrip("\ufeff")
            yield "file", parse_document({"id": text_doc_id(path), "text": text}, path)
        elif fmt == "parquet":
            import pyarrow.parquet as pq

            with fsspec.open(path, "rb") as fh:
                pf = pq.ParquetFile(fh)
                missing = {"id", "text"} - set(pf.schema_arrow.names)
                if missing:
                    raise DataError(f"{path}: no column {sorted(missing)[0]!r} (a document has 'id' and 'text')")
                groups = range(start, pf.metadata.num_row_groups if end == WHOLE else end)
                row = sum(pf.metadata.row_group(g).num_rows for g in range(start))
                for batch in pf.iter_batches(columns=["id", "text"], batch_size=1024, row_groups=list(groups)):
                    for rec in batch.to_pylist():
                        yield f"row {row}", parse_document(rec, f"{path}: row {row}")
                        row += 1
        else:
            raise DataError(f"{path}: unknown format {fmt!r}")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    except Exception as exc:  # pyarrow's errors (a file that is no parquet)
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{path}: cannot read as {fmt}: {exc}") from None


def read_documents(files: Sequence[tuple[str, str]]) -> Iterator[Document]:
    """The documents of ``files`` ((path, format) from :func:`expand_inputs`), in order."""
    for path, fmt in files:
        for _, doc in read_records(path, fmt):
            yield doc


def count_documents(files: Sequence[tuple[str, str]]) -> int | None:
    """Documents in ``files``, a progress bar's total: None when one is not a local file (counting
    would download it twice)."""
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    if not all(isinstance(url_to_fs(path)[0], LocalFileSystem) for path, _ in files):
        return None
    return sum(1 for _ in read_documents(files))
