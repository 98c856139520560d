"""The retriever's encoders behind a token interface for indexing and serving.

A model comes from a checkpoint directory, an MLflow URI (``runs:/<run_id>/<path>``,
``models:/<name>/<version>``, ``models:/<name>@<alias>``; downloaded once per version into a
cache folder) or, with none given, the
bundled untrained encoder (positions off: a pretrained encoder knows nothing of rotations).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qrag.model.checkpoint import (
    CheckpointError,
    fingerprint as checkpoint_fingerprint,
    is_checkpoint,
    load_qnet,
    read_meta,
    untrained_qnet,
)
from qrag.config import ModelConfig, from_dict, to_dict
from qrag.data.chunking import tokenizer_counter
from qrag.data.documents import Document, DocumentChunk, chunk_and_encode, chunk_documents
from qrag.model.encoder import load_tokenizer, pick_device, resolve_encoder
from qrag.retrieval.search import Retriever
from qrag.model.state_graphs import GraphedEncoder
from qrag.data.tokens import TokenLayout
from qrag.data.word_cache import WordCache

MLFLOW_SCHEMES = ("runs:/", "models:/", "mlflow-artifacts:/")


@dataclass(frozen=True)
class ModelSource:
    """Where the served model comes from, resolved to a local directory."""

    spec: str | None  # what the user configured (None = the bundled untrained encoder)
    directory: Path | None  # the checkpoint directory (None = untrained encoder)
    encoder: str  # the encoder name used when there is no checkpoint

    @property
    def trained(self) -> bool:
        return self.directory is not None

    def describe(self) -> str:
        return self.spec if self.spec else f"untrained encoder {self.encoder!r} (no checkpoint configured)"

    @property
    def tokenizer_dir(self) -> str:
        """The tokenizer's folder: the checkpoint's copy, or the untrained encoder's own."""
        return str(self.directory / "tokenizer") if self.directory is not None else resolve_encoder(self.encoder)


def resolve_source(
    spec: str | None, encoder: str = "minilm", cache_dir: str | Path = ".qrag_models", tracking_uri: str | None = None
) -> ModelSource:
    """A checkpoint directory or MLflow URI -> a local checkpoint directory (downloading once).

    ``runs:/`` and ``models:/`` URIs are looked up in ``tracking_uri`` (default: $MLFLOW_TRACKING_URI).
    """
    if not spec:
        return ModelSource(None, None, encoder)
    if spec.startswith(MLFLOW_SCHEMES):
        return ModelSource(spec, _download_mlflow(spec, Path(cache_dir), tracking_uri), encoder)
    path = Path(spec).expanduser()
    read_meta(path)  # a clear CheckpointError when it is not a checkpoint
    return ModelSource(spec, path, encoder)


def _pin_alias(uri: str, tracking_uri: str | None) -> str:
    """``models:/<name>@<alias>`` -> ``models:/<name>/<version>`` the alias points at now, so that
    the download cache follows the alias when it moves (a restart then serves the new version)."""
    if not uri.startswith("models:/") or "@" not in uri:
        return uri
    from mlflow import MlflowClient  # noqa: PLC0415

    name, _, rest = uri[len("models:/") :].partition("@")
    alias, slash, path = rest.partition("/")
    try:
        version = (
            MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
            .get_model_version_by_alias(name, alias)
            .version
        )
    except Exception as exc:  # mlflow raises many types (MlflowException, OSError, ...)
        raise CheckpointError(f"{uri}: cannot resolve the alias in the model registry: {exc}") from None
    return f"models:/{name}/{version}{slash}{path}"


def _download_mlflow(uri: str, cache_dir: Path, tracking_uri: str | None) -> Path:
    try:
        import mlflow.artifacts  # noqa: PLC0415 (heavy; only for MLflow URIs)
    except ImportError:
        raise CheckpointError(f"{uri}: loading MLflow URIs needs mlflow (pip install mlflow-skinny)") from None
    uri = _pin_alias(uri, tracking_uri)
    target = cache_dir / hashlib.sha256(f"{tracking_uri}|{uri}".encode()).hexdigest()[:16]
    if not _find_checkpoint(target):
        target.mkdir(parents=True, exist_ok=True)
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(target), tracking_uri=tracking_uri)
        except Exception as exc:  # mlflow raises many types (MlflowException, OSError, ...)
            raise CheckpointError(f"{uri}: cannot download the checkpoint from MLflow: {exc}") from None
    found = _find_checkpoint(target)
    if found is None:
        raise CheckpointError(f"{uri}: the downloaded artifacts hold no qrag checkpoint (no qrag.json)")
    return found


def _find_checkpoint(root: Path) -> Path | None:
    if not root.is_dir():
        return None
    if is_checkpoint(root):
        return root
    hits = sorted(p.parent for p in root.rglob("qrag.json"))
    return hits[0] if hits else None


def encoder_fingerprint(model_cfg: ModelConfig, encoder_dir: str) -> str:
    """Like :func:`qrag.model.checkpoint.fingerprint` for an encoder that is no checkpoint."""
    digest = hashlib.sha256()
    digest.update(json.dumps(to_dict(model_cfg), sort_keys=True).encode())
    for file in sorted(Path(encoder_dir).glob("*.safetensors")):
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def source_identity(source: ModelSource) -> tuple[str, ModelConfig, Any, TokenLayout]:
    """(fingerprint, model config, tokenizer, layout) without loading any weights: what an
    ingress needs to tokenise and to check corpora against the model."""
    if source.directory is not None:
        meta = read_meta(source.directory)
        model_cfg = from_dict(ModelConfig, meta["model"])
        tokenizer = load_tokenizer(str(source.directory / "tokenizer"))
        return (
            checkpoint_fingerprint(source.directory),
            model_cfg,
            tokenizer,
            TokenLayout.from_tokenizer(tokenizer, model_cfg.max_state_tokens),
        )
    model_cfg = untrained_model_cfg(source.encoder)
    path = resolve_encoder(model_cfg.encoder)
    tokenizer = load_tokenizer(path)
    return (
        encoder_fingerprint(model_cfg, path),
        model_cfg,
        tokenizer,
        TokenLayout.from_tokenizer(tokenizer, model_cfg.max_state_tokens),
    )


def untrained_model_cfg(encoder: str, positions: str = "none") -> ModelConfig:
    return replace(ModelConfig(), encoder=encoder, positions=positions)


class Tokenization:
    """Text -> token arrays exactly as :func:`qrag.data.tokens.tokenize_samples` makes them."""

    def __init__(self, tokenizer, layout: TokenLayout, question_tokens: int = 64):
        self.tokenizer, self.layout, self.question_tokens = tokenizer, layout, question_tokens
        self.count_tokens = tokenizer_counter(tokenizer)

    # Sentences that a tokenizer splitting at spaces tokenises the same alone or joined; a
    # byte-level BPE ("Ġit" inside a text, "it" at its start) or a cased/NFKC quirk shows here.
    _JOIN_PROBES = (
        ["Mary went to the kitchen.", "It's late; isn't it?"],
        ['"Go!" he said.', "(Then) 3.5 km — 12:30."],
        ["Élodie's café.", "naïve Straße, 東京!"],
        ["A.", "b", "C-3PO's e-mail."],
    )

    @functools.cached_property
    def joins_at_spaces(self) -> bool:
        """Whether a text's token ids are its space-joined parts' ids one after another (so a chunk
        can be tokenised once, as its sentences): checked on probe texts, not assumed."""
        tok = self.tokenizer
        for parts in self._JOIN_PROBES:
            alone = [i for x in tok(parts, add_special_tokens=False)["input_ids"] for i in x]
            if alone != tok([" ".join(parts)], add_special_tokens=False)["input_ids"][0]:
                return False
        return True

    @functools.cached_property
    def _fast_backend(self):
        """The Rust tokenizer behind a fast tokenizer, without the truncation and padding its
        tokenizer.json may carry (MiniLM's: 128), or None. Its ``encode_batch_fast`` skips the
        character offsets and the per-text Python objects transformers builds, so tokenising for
        an index is faster this way, with the same ids (tests compare them)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "encode_batch_fast"):
            return None
        backend = copy.deepcopy(backend)
        backend.no_truncation()
        backend.no_padding()
        return backend

    @functools.cached_property
    def _word_cache(self) -> WordCache | None:
        """ASCII prose through a cache of words (:mod:`qrag.data.word_cache`: the same ids, several
        times faster per process), where that is this tokenizer's exact behaviour."""
        return WordCache.for_backend(self._fast_backend) if self._fast_backend is not None else None

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self._word_cache is not None:
            return self._word_cache.encode(texts)
        backend = self._fast_backend
        if backend is not None:
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def chunk_documents(
        self, docs: Sequence[Document], chunk_tokens: int
    ) -> tuple[list[DocumentChunk], list[np.ndarray]]:
        """Documents -> chunks (:func:`qrag.data.documents.chunk_documents`) and their encoder ids
        (what :meth:`tokenize_chunks` gives), tokenising each sentence once where the tokenizer
        allows it (:attr:`joins_at_spaces`), else tokenising the chunks again."""
        if self.joins_at_spaces:
            chunks, ids = chunk_and_encode(docs, self.encode_texts, chunk_tokens)
            return chunks, [self.layout.wrap(x[:chunk_tokens]) for x in ids]
        chunks = chunk_documents(docs, self.count_tokens, chunk_tokens)
        return chunks, self.tokenize_chunks([c.text for c in chunks], chunk_tokens)

    def tokenize_chunks(self, texts: Sequence[str], chunk_tokens: int) -> list[np.ndarray]:
        if not texts:
            return []
        ids = self.tokenizer(list(texts), add_special_tokens=False, truncation=True, max_length=chunk_tokens)[
            "input_ids"
        ]
        return [self.layout.wrap(x) for x in ids]

    def tokenize_question(self, text: str) -> np.ndarray:
        ids = self.tokenizer([text], add_special_tokens=False, truncation=True, max_length=self.question_tokens)[
            "input_ids"
        ][0]
        return self.layout.wrap(ids)


class EmbeddingModel(Tokenization):
    """State and chunk encoders of one model, on one device, with encoder-work counters."""

    def __init__(
        self,
        qnet,
        tokenizer,
        layout: TokenLayout,
        device: torch.device,
        fingerprint: str,
        source: ModelSource,
        encode_tokens: int = 32768,
        question_tokens: int = 64,
        chunk_batch: int = 4096,
    ):
        super().__init__(tokenizer, layout, question_tokens)
        self.qnet, self.device, self.fingerprint, self.source = qnet, device, fingerprint, source
        self.retriever = Retriever(qnet, layout, device, encode_tokens)
        # On GPU, states go through fixed shapes replayed from CUDA graphs (qrag.model.state_graphs):
        # one short state eagerly is launch overhead, not compute. CPU keeps the exact-width path.
        self.state_encoder = GraphedEncoder(qnet, layout.pad_id, device) if device.type == "cuda" else None
        # Chunks too (indexing): one replay per batch instead of ~100 ops that each hand the GIL to
        # the threads gathering input and writing the store (docs/benchmarks.md, "Indexing").
        self.chunk_encoder = GraphedEncoder.for_chunks(qnet, layout.pad_id, device) if device.type == "cuda" else None
        self.chunk_batch = chunk_batch
        self.chunks_embedded = 0  # chunk sequences encoded since start (re-embedding shows here)
        self.states_embedded = 0

    def replica(self, device: str | torch.device) -> EmbeddingModel:
        """The same weights on another device (one more GPU embedding while indexing:
        ``qrag.index.pipeline.index_groups(..., replicas=...)``)."""
        dev = pick_device(str(device)) if not isinstance(device, torch.device) else device
        qnet = copy.deepcopy(self.qnet).to(dev)
        return EmbeddingModel(
            qnet,
            self.tokenizer,
            self.layout,
            dev,
            self.fingerprint,
            self.source,
            self.retriever.encode_tokens,
            self.question_tokens,
            self.chunk_batch,
        )

    @property
    def model_cfg(self) -> ModelConfig:
        return self.qnet.cfg

    @property
    def dim(self) -> int:
        return self.qnet.dim

    def embed_chunks(self, seqs: Sequence[np.ndarray]) -> np.ndarray:
        return self.embed_chunks_start(seqs)()

    def embed_chunks_start(self, seqs: Sequence[np.ndarray]) -> Callable[[], np.ndarray]:
        """Start embedding ``seqs``; the returned function waits for the vectors ([N, d] float32).

        On CUDA the forward passes are only queued here and the vectors come back through a pinned
        host buffer (non-blocking copy, an event to wait on), so the caller can prepare and queue
        the next batch while the device works on this one. On CPU the work is done here, exactly
        as before (same numbers)."""
        self.chunks_embedded += len(seqs)
        graphed = self.chunk_encoder
        if graphed is not None and all(len(s) <= graphed.length_buckets[-1] for s in seqs):
            vectors = graphed.encode_sorted(list(seqs), self.retriever.encode_tokens)
        else:
            vectors = self.retriever.embed_chunks(list(seqs), self.chunk_batch)
        if self.device.type != "cuda":
            out = vectors.cpu().numpy()
            return lambda: out
        host = torch.empty(vectors.shape, dtype=vectors.dtype, pin_memory=True)
        host.copy_(vectors, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))

        def result() -> np.ndarray:
            done.synchronize()  # releases the GIL while waiting: other stages keep running
            return host.numpy().copy()  # pageable: the pinned buffer goes back to torch's cache

        return result

    def warm_up(self, max_batch: int) -> int:
        """Capture the state encoder's graphs for up to ``max_batch`` states of any length up to
        the layout's (GPU; a no-op on CPU): a serving replica does it at start. Shapes ready."""
        if self.state_encoder is None:
            return 0
        return self.state_encoder.warm_up(max_batch, self.layout.max_state_tokens)

    def warm_up_chunks(self, chunk_tokens: int) -> int:
        """Make the chunk encoder ready for indexing chunks of up to ``chunk_tokens`` tokens
        (:meth:`GraphedEncoder.warm_up_sorted`; GPU, a no-op on CPU). Shapes captured."""
        if self.chunk_encoder is None:
            return 0
        return self.chunk_encoder.warm_up_sorted(chunk_tokens + len(self.layout.wrap([])), self.retriever.encode_tokens)

    def embed_states(self, seqs: Sequence[np.ndarray]) -> np.ndarray:
        self.states_embedded += len(seqs)
        if self.state_encoder is not None and all(len(s) <= self.state_encoder.length_buckets[-1] for s in seqs):
            return self.state_encoder(list(seqs)).cpu().numpy()
        return self.retriever.embed_states(list(seqs)).cpu().numpy()

    def info(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "source": self.source.describe(),
            "trained": self.source.trained,
            "positions": self.model_cfg.positions,
            "dim": self.dim,
            "device": str(self.device),
            "encoder": self.model_cfg.encoder,
        }


def load_embedding_model(
    source: ModelSource,
    device: str | torch.device = "auto",
    *,
    positions: str | None = None,
    encode_tokens: int = 32768,
    question_tokens: int = 64,
    chunk_batch: int = 4096,
) -> EmbeddingModel:
    """Load the online encoders of a checkpoint (no targets), or the untrained encoder.

    ``positions`` overrides the positions mode of an untrained encoder (benchmarks of the
    rotated scoring path); a checkpoint's own mode always wins.
    """
    dev = pick_device(str(device)) if not isinstance(device, torch.device) else device
    if source.directory is not None:
        qnet, tokenizer, layout, _ = load_qnet(source.directory, dev, with_targets=False)
        fp = checkpoint_fingerprint(source.directory)
    else:
        model_cfg = untrained_model_cfg(source.encoder, positions or "none")
        qnet, tokenizer, layout = untrained_qnet(model_cfg, dev, use_target=False)
        fp = encoder_fingerprint(model_cfg, resolve_encoder(model_cfg.encoder))
    return EmbeddingModel(qnet, tokenizer, layout, dev, fp, source, encode_tokens, question_tokens, chunk_batch)
