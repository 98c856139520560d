"""The HTTP API's request and response bodies as pydantic models: the server validates requests
with them and declares its answers with them (OpenAPI at /docs), and :mod:`qrag.client` parses
answers into them. Pydantic only, so a client imports them without the server's heavy imports.

Requests are strict (unknown fields are refused); answers allow fields added later, so an older
client keeps working against a newer server.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from qrag.config import BeamScore

# -- requests -------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DocumentIn(_Strict):
    id: StrictStr | StrictInt = Field(description="Document id, unique within the corpus.")
    text: StrictStr = Field(description="The document's text (UTF-8); split into sentence-aligned chunks.")


class CreateCorpus(_Strict):
    name: StrictStr = Field(description="1-64 letters, digits, '.', '_' or '-'.")
    documents: list[DocumentIn] = Field(
        default_factory=list, description="Documents to index now (more can be appended)."
    )
    chunk_tokens: StrictInt | None = Field(
        None, description="Token budget per chunk (default: the server's chunk_tokens)."
    )
    wait: StrictBool = Field(True, description="false: answer 202 at once with a job to poll at /v1/jobs/{id}.")


class AppendDocuments(_Strict):
    documents: list[DocumentIn]
    wait: StrictBool = Field(True, description="false: answer 202 at once with a job to poll at /v1/jobs/{id}.")


class Reindex(_Strict):
    wait: StrictBool = Field(False, description="true: answer when the re-index ends (or 202 after job_wait_s).")


class RetrieveRequest(_Strict):
    question: StrictStr
    corpus: StrictStr | None = Field(None, description="An indexed corpus ...")
    context: StrictStr | None = Field(None, description="... or one long inline document (not stored).")
    max_steps: StrictInt = Field(2, description="Retrieval steps T.")
    beam_width: StrictInt = Field(1, description="1 = greedy; >1 = beam search over Q.")
    beam_score: BeamScore = Field(
        "min",
        description="How beam search ranks a path: min (its lowest Q; soft PQN), last (its last Q), logprob (the "
        "policy's log-probability, softmax(Q/beam_temperature) per step; supervised checkpoints).",
    )
    beam_temperature: StrictFloat | StrictInt = Field(
        0.05, description="beam_score=logprob: the policy's temperature (the learner's; > 0)."
    )
    stop_threshold: StrictFloat | StrictInt | None = Field(None, description="Stop when the best Q falls below it.")
    alternatives: StrictInt = Field(3, description="Runner-up chunks reported per step.")
    chunk_tokens: StrictInt | None = Field(None, description="Inline context only: token budget per chunk.")
    return_chunks: StrictBool = Field(False, description="Inline context only: return the chunk texts too.")


# -- answers --------------------------------------------------------------------------------------


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Answer):
    status: int
    field: str | None = Field(
        description="The request field at fault (documents[3].text, authorization, ...), or null."
    )
    message: str


class ErrorBody(_Answer):
    error: ErrorDetail


class CorpusSummary(_Answer):
    name: str
    fingerprint: str = Field(description="The model the corpus was indexed with.")
    dim: int
    chunk_tokens: int
    shards: int
    dtype: str
    version: int
    documents: int
    chunks: int
    tokens: int
    created: float
    updated: float
    positions: str
    batches: int


class CorpusStats(CorpusSummary):
    bytes: int = Field(description="Bytes on disk.")
    memory_bytes: int = Field(description="Bytes loaded in the shard holders that answered.")
    shard_holders: list[dict[str, Any]]
    compatible: bool = Field(description="Indexed with the served model (false: POST .../reindex).")


class CorpusList(_Answer):
    corpora: list[CorpusSummary]


class JobError(_Answer):
    status: int
    field: str | None
    message: str


class Job(_Answer):
    id: str
    corpus: str
    kind: str = Field(description="create | append | reindex")
    state: str = Field(description="queued | running | done | failed")
    documents: int
    chunks_total: int
    chunks_done: int
    progress: float
    error: JobError | None
    created: float
    started: float | None
    finished: float | None


class JobAnswer(_Answer):
    """A write's answer: the corpus (null while a create is still indexing) and its job (null
    when nothing had to be indexed)."""

    corpus: CorpusSummary | None
    job: Job | None


class CorpusJobs(_Answer):
    corpus: str
    jobs: list[Job]


class Deleted(_Answer):
    deleted: str


class ChunkHit(_Answer):
    chunk_id: int = Field(description="Global position of the chunk in the corpus (or the inline context).")
    doc_id: str
    text: str
    q: float


class Step(_Answer):
    step: int
    chunk_id: int
    doc_id: str
    text: str
    q: float
    position: float | int | None = Field(
        description="The chunk's position as the Q-network saw it (null: positions off)."
    )
    alternatives: list[ChunkHit] = Field(description="Runner-up chunks of this step, best first.")


class SearchSettings(_Answer):
    max_steps: int
    beam_width: int
    beam_score: str
    beam_temperature: float
    stop_threshold: float | None
    alternatives: int


class ServedModel(_Answer):
    fingerprint: str
    trained: bool


class RetrieveAnswer(_Answer):
    corpus: str | None
    question: str
    steps: list[Step]
    stopped_early: bool
    n_chunks: int
    timings: dict[str, float] = Field(description="Milliseconds per stage: tokenize, encode, score, merge, total.")
    search: SearchSettings
    model: ServedModel
    chunks: list[str] | None = Field(None, description="Inline context with return_chunks: the chunk texts.")


class ModelInfo(_Answer):
    fingerprint: str
    source: str
    trained: bool
    positions: str
    dim: int
    encoder: str


class Health(_Answer):
    """``status`` alone for a request without a key to a server with keys; the rest needs a read key."""

    status: str
    model: ModelInfo | None = None
    message: str | None = None
    shards: int | None = None
    corpora: int | None = None


__all__ = [
    "AppendDocuments",
    "CorpusJobs",
    "CorpusList",
    "CorpusStats",
    "CorpusSummary",
    "CreateCorpus",
    "Deleted",
    "DocumentIn",
    "ErrorBody",
    "ErrorDetail",
    "Health",
    "Job",
    "JobAnswer",
    "Reindex",
    "RetrieveAnswer",
    "RetrieveRequest",
]
