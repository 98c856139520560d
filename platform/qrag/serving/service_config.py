"""Configuration of the retrieval service (``serve/config.yaml`` args, ``qrag serve`` flags)."""

from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING, Literal

from qrag.config import Device, opt

if TYPE_CHECKING:
    import torch

    from qrag.index.shards import ShardOptions

# `qrag serve --ingress`, and the Ray environment each one starts Ray with: Serve's Python HTTP proxy per
# node, or Serve's HAProxy ingress (HAProxy on the port, each Ingress replica serving HTTP itself behind it).
INGRESS_ENV: dict[str, dict[str, str]] = {"proxy": {}, "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1"}}
INGRESSES = tuple(INGRESS_ENV)
PREFERRED_INGRESS = "haproxy"  # `qrag serve`'s default where HAProxy can start, else Serve's proxy


@dataclass
class ServeConfig:
    """The model, the storage and the limits of one retrieval service: the app's ``args``.
    Replicas, autoscaling, GPUs and per-replica request limits are Serve deployment options, set
    in the config's ``deployments:`` section (qrag.distributed.serving.build_app)."""

    checkpoint: str | None = opt(
        None,
        "Checkpoint directory or MLflow URI (runs:/<run>/<path>, models:/<name>/<version>); "
        "none = the bundled untrained encoder.",
    )
    encoder: str = opt("minilm", "Encoder used when no checkpoint is configured.")
    mlflow_tracking_uri: str | None = opt(
        None, "MLflow store that runs:/ and models:/ URIs refer to (default: $MLFLOW_TRACKING_URI)."
    )
    model_cache: str = opt(".qrag_models", "Where MLflow checkpoints are downloaded to (once per URI).")
    storage: str = opt("qrag_indexes", "Directory of the persisted corpora (shared by every replica).")
    dtype: Literal["float32", "float16"] = opt(
        "float32",
        "Vectors on disk: float32 | float16 (half the bytes; scores then differ slightly from offline search).",
    )
    chunk_tokens: int = opt(64, "Default token budget per chunk of new corpora and inline contexts.")
    question_tokens: int = opt(64, "Questions are truncated to this many tokens.")
    shards: int = opt(2, "A corpus is split into this many shards when created.")
    shard_deployments: int = opt(
        0,
        "0: every Ingress replica holds the encoder and all shards itself, and a query makes no "
        "deployment-handle call (one replica per GPU). D > 0: the shards live in D Shard deployments "
        "(deployment i holds shards i, i + D, ...), for corpora beyond one GPU's memory; each is "
        "called once per retrieval step for all the requests of that step.",
    )
    encoder_device: Device = opt("auto", "Device of the encoder (in the Ingress replicas): auto | cpu | cuda | cuda:N.")
    shard_device: Device = opt("auto", "Device of the shards (exact rotated scoring): auto | cpu | cuda | cuda:N.")
    replicas_per_gpu: int = opt(
        2,
        "Ingress replicas sharing each GPU when it holds the shards (shard_deployments: 0) and the "
        "deployments: section sets no num_replicas: each replica parses and answers requests in its own "
        "process (one Python interpreter per replica), each holds a copy of the model and the corpora.",
    )
    state_batch_size: int = opt(
        64,
        "State rows per retrieval round: the concurrent requests of a replica are stepped together, "
        "one encoder call and one scoring pass per corpus a round, up to this many states; more wait a round.",
    )
    warm_up: bool = opt(
        True,
        "On a GPU, capture at replica start what queries replay: the state encoder's CUDA graphs for every "
        "batch up to state_batch_size and every state length, and the scoring graphs of every corpus loaded.",
    )
    preload: bool = opt(
        True,
        "Load every stored corpus into the shards at replica start (within shard_memory_bytes), so that "
        "the first query of a corpus does not wait for its load.",
    )
    warm_steps: int = opt(
        4, "Retrieval steps whose scoring graphs are captured at start (selected sets up to warm_steps - 1 chunks)."
    )
    chunk_batch: int = opt(512, "Chunks per encoder call while indexing (progress is reported per call).")
    encode_tokens: int = opt(32768, "Padded tokens per encoder forward pass.")
    faiss: Literal["auto", "always", "never"] = opt(
        "auto", "FAISS for shards when positions are off: auto (CPU shards) | always | never."
    )
    approx_above: int = opt(2_000_000, "Chunks per shard above which FAISS uses an approximate (HNSW) index.")
    ann: Literal["auto", "always", "never"] = opt(
        "auto",
        "Candidates from an approximate FAISS index (on the shard's GPU with a GPU FAISS), re-scored exactly "
        "with positions: auto (shards beyond ann_above chunks) | always | never. Models without positions "
        "or with relative ones; absolute positions always score exactly.",
    )
    ann_above: int = opt(4_000_000, "Chunks per shard beyond which `ann: auto` takes candidates approximately.")
    ann_index: Literal["ivf_pq", "ivf_flat", "flat"] = opt(
        "ivf_pq", "The candidate index: ivf_pq (compressed codes) | ivf_flat | flat (exact inner products)."
    )
    ann_nprobe: int = opt(32, "Inverted lists searched per probe.")
    ann_probes: int = opt(2, "Positions per segment between selected chunks that a state is searched at.")
    ann_candidates: int = opt(256, "Chunks kept per probe for exact re-scoring.")
    score_graphs: bool = opt(
        True,
        "GPU shards: replay each scoring step from a CUDA graph (per batch bucket); "
        "false = the same step launched eagerly.",
    )
    retry_after_s: int = opt(1, "Retry-After seconds sent with 503 on overload.")
    max_body_bytes: int = opt(32 * 1024 * 1024, "Largest request body accepted (413 beyond).")
    max_documents: int = opt(10000, "Documents per create/append request; send more in several requests.")
    max_question_chars: int = opt(2000, "Longest question accepted.")
    max_context_chars: int = opt(1_000_000, "Longest inline context accepted.")
    max_steps: int = opt(16, "Upper bound of a request's max_steps.")
    max_beam_width: int = opt(8, "Upper bound of a request's beam_width.")
    max_alternatives: int = opt(10, "Upper bound of a request's alternatives.")
    max_word_chars: int = opt(
        2000,
        "Longest run of characters without a space in a document or context (422 beyond): "
        "one such run becomes one chunk, copied into every answer that picks it.",
    )
    jobs_kept: int = opt(200, "Finished indexing jobs kept on disk (with their outcome) for GET /v1/jobs/{id}.")
    max_jobs: int = opt(
        16, "Indexing jobs queued or running at once over all corpora and replicas; more get 429 + Retry-After."
    )
    max_jobs_per_corpus: int = opt(4, "Indexing jobs queued or running at once per corpus; more get 429 + Retry-After.")
    job_workers: int = opt(2, "Indexing jobs one ingress replica runs at once (the others wait, queued).")
    job_wait_s: float = opt(
        30.0,
        "How long a wait:true request waits for its job; past it the answer is 202 with the job, which goes on "
        "(at most 80% of request_timeout_s).",
    )
    job_heartbeat_s: float = opt(5.0, "How often a replica rewrites its running jobs' records (progress, liveness).")
    job_stale_s: float = opt(
        30.0,
        "A job record not rewritten for this long belongs to a stopped server: it is reported failed (interrupted).",
    )
    shard_memory_bytes: int | None = opt(
        None,
        "Memory budget of each index-shard holder for loaded corpora "
        "(least recently used ones are evicted; a corpus that cannot fit gets 507); "
        "null = shard_memory_fraction of the machine.",
    )
    shard_memory_fraction: float = opt(
        0.5,
        "With shard_memory_bytes null, the budget is this share of the memory free when a shard holder starts: "
        "the host's available memory (within its cgroup limit) for shards on the CPU, "
        "the GPU's free memory for shards on a GPU; shared out among the holders of one process. 0 = no limit.",
    )
    api_keys: str | None = opt(
        None,
        "API keys, 'key:scope,key:scope' with scope read or write (write implies read), added to $QRAG_API_KEYS. "
        "Prefer the environment variable or a Kubernetes Secret to this field.",
    )
    http_host: str | None = opt(
        None,
        "The address Serve's HTTP proxies bind (http_options.host; `qrag serve` sets it from --host): "
        "without API keys the app starts only when it is loopback, unless allow_unauthenticated. "
        "null = unknown, taken as public.",
    )
    allow_unauthenticated: bool = opt(
        False, "Serve without API keys on a non-loopback address (by default the app refuses to start)."
    )
    allowed_hosts: list[str] = opt(
        ["localhost", "127.0.0.1", "[::1]"],
        "Host header values accepted (421 otherwise; protects a loopback server from DNS rebinding); '*' accepts any.",
    )
    cors_origins: list[str] = opt(
        [], "Origins whose web pages may call the API (CORS); empty = none, and cross-origin writes are refused."
    )
    request_timeout_s: float = opt(
        60.0, "Longest time one request may take in the ingress (503 beyond); clients cannot lift it."
    )
    handle_timeout_s: float = opt(30.0, "Longest wait for one call to a Shard deployment (503 + Retry-After beyond).")

    def shard_holders(self) -> int:
        """Shard holders: the Shard deployments, or 1 (every shard in the Ingress replica)."""
        n = self.shard_deployments
        if not 0 <= n <= self.shards:
            raise ValueError(f"shard_deployments must be between 0 and shards ({self.shards}), got {n}")
        return max(1, n)

    def shard_budget(self, device: torch.device, holders: int = 1) -> int | None:
        """The memory budget of one of ``holders`` shard holders on ``device`` in a process."""
        from qrag.index.holder import machine_budget  # torch: not for reading a config

        if self.shard_memory_bytes is not None:
            return self.shard_memory_bytes
        return machine_budget(device, self.shard_memory_fraction, holders)

    def shard_options(self) -> ShardOptions:
        """How this service's shards score (the Ray shard deployments and the in-process service alike)."""
        from qrag.index.shards import ShardOptions  # torch: not for reading a config (`qrag serve --help`)

        from qrag.index.ann import AnnSettings  # noqa: PLC0415

        for key in ("ann_nprobe", "ann_probes", "ann_candidates"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1, got {getattr(self, key)}")
        ann = AnnSettings(
            kind=self.ann_index, nprobe=self.ann_nprobe, probes=self.ann_probes, candidates=self.ann_candidates
        )
        return ShardOptions(
            faiss=self.faiss,
            approx_above=self.approx_above,
            graphs=self.score_graphs,
            ann=self.ann,
            ann_above=self.ann_above,
            ann_settings=ann,
        )
