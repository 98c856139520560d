"""Failures of the retrieval service as HTTP answers: a status, the request field at fault and a
message, mapped once from the library's errors (data, store, storage)."""

from __future__ import annotations

import errno
import re
from typing import Any

from qrag.data.sample import DataError
from qrag.index.holder import ShardOverBudget
from qrag.index.store import CorpusConflict, CorpusNotFound, StoreError


class ServiceError(Exception):
    """An HTTP-mappable failure: status, the request field at fault, a message."""

    def __init__(self, status: int, field: str | None, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.field, self.message, self.headers = status, field, message, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"status": self.status, "field": self.field, "message": self.message}}

    def __reduce__(self):  # picklable across processes (Ray): keeps status, field and headers
        return (ServiceError, (self.status, self.field, self.message, self.headers))


_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.*)$", re.S)


def data_error(exc: DataError, status: int = 422) -> ServiceError:
    """DataError messages start with the field they are about (``documents[3].text: ...``)."""
    match = _FIELD.match(str(exc))
    return ServiceError(status, match.group(1) if match else None, str(exc))


def store_error(exc: StoreError, corpus: str | None = None) -> ServiceError:
    """A store failure as an answer: unknown corpus 404, conflict 409, over the memory budget
    507, anything else (unreadable or damaged files) 503 naming the corpus."""
    if isinstance(exc, CorpusNotFound):
        return ServiceError(404, "corpus", str(exc))
    if isinstance(exc, CorpusConflict):
        return ServiceError(409, "corpus", str(exc))
    if isinstance(exc, ShardOverBudget):
        return ServiceError(507, "corpus", str(exc))
    named = corpus is None or repr(corpus) in str(exc)
    return ServiceError(503, "corpus", str(exc) if named else f"corpus {corpus!r}: {exc}", {"Retry-After": "5"})


def os_error(exc: OSError) -> ServiceError:
    """The storage failed under a request: full (507) or otherwise unavailable (503); the
    message names the errno, not the server's paths."""
    if isinstance(exc, TimeoutError):  # an OSError too, since Python 3.10
        return ServiceError(503, None, "an operation timed out; retry", {"Retry-After": "5"})
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ServiceError(507, None, "the index storage is full; nothing of this request was stored")
    reason = errno.errorcode.get(exc.errno, "I/O error")
    return ServiceError(503, None, f"the index storage failed ({reason}); retry", {"Retry-After": "5"})


def overloaded(what: str, retry_after_s: int, why: str = "is overloaded or restarting") -> ServiceError:
    """A backend (encoder, index shard) that cannot answer now: 503 with Retry-After."""
    return ServiceError(503, None, f"{what} {why}; retry", {"Retry-After": str(retry_after_s)})
