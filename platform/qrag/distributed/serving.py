"""Ray Serve deployments of the retrieval service.

* ``Encoder``  the state and chunk encoders (GPU when the cluster has one); concurrent requests'
               states are batched into one forward pass with ``@serve.batch``.
* ``Shard<i>`` one deployment per shard slot: holds shards i, i+N, ... of every corpus, loaded
               from the shared storage (never re-embedded), exact rotated scoring in torch.
* ``Ingress``  FastAPI (``qrag.serving.http_api``) around ``qrag.serving.service.RetrievalService``; fans a
               query step out to the shards and merges their top-k.

Replicas, autoscaling, GPUs and request limits are deployment options, set the Serve way: the
``deployments:`` section of ``serve/config.yaml`` (or a RayService's serveConfigV2) overrides the
defaults below per deployment name (``Ingress``, ``Encoder``, ``Shard0``..); ``qrag serve
--config`` applies the same section through :func:`build_app`.

Metrics go through ``ray.serve.metrics`` to Ray's Prometheus exporter (``qrag_*``). Every call
to the encoder or a shard has a deadline; any failure of theirs (overload, a restarting
replica, a CUDA out-of-memory) answers 503 with Retry-After, never a 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.metrics import Counter, Histogram

from qrag.serving.auth import ApiKeyError, key_table, startup_problem
from qrag.config import ConfigError, ModelConfig, from_dict, to_dict
from qrag.retrieval.embedder import Tokenization, load_embedding_model, resolve_source, source_identity
from qrag.model.encoder import pick_device
from qrag.serving.http_api import build_api
from qrag.index.holder import ShardHolder, ShardOverBudget
from qrag.index.shards import ShardUnhealthy
from qrag.retrieval.hits import ShardHits
from qrag.index.store import CorpusNotFound, CorpusStore, SegmentProblem
from qrag.serving.service import ModelIdentity, RetrievalService, ServiceError, encoder_positions, local_service
from qrag.serving.service_config import ServeConfig

log = logging.getLogger("qrag.serving")
PROXY_CALLBACK = "qrag.distributed.proxy_guard:middlewares"

LATENCY_BOUNDS = [0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]


INGRESS, ENCODER = "Ingress", "Encoder"
BACKEND_LIMITS = {"max_ongoing_requests": 64, "max_queued_requests": 512}  # per encoder / shard replica


def shard_name(slot: int) -> str:
    return f"Shard{slot}"


def deployment_names(shards: int) -> list[str]:
    """The deployments of the app with ``shards`` shard slots (0: colocated, the Ingress alone):
    the names ``deployments:`` uses."""
    if shards == 0:
        return [INGRESS]
    return [INGRESS, ENCODER, *(shard_name(i) for i in range(shards))]


def serving_source(c: ServeConfig):
    """The model the service serves (checkpoint, MLflow URI or the bundled encoder)."""
    return resolve_source(c.checkpoint, c.encoder, c.model_cache, c.mlflow_tracking_uri)


def serving_model(c: ServeConfig):
    """The encoders as the service runs them: the Encoder deployment's, or a colocated Ingress's."""
    model = load_embedding_model(serving_source(c), c.encoder_device, encode_tokens=c.encode_tokens,
                                 question_tokens=c.question_tokens, chunk_batch=c.chunk_batch)
    if c.warm_up:
        model.warm_up(max(c.state_batch_size, c.max_beam_width))
    return model


@serve.deployment(name=ENCODER, ray_actor_options={"num_cpus": 0}, **BACKEND_LIMITS)
class Encoder:
    def __init__(self, cfg: dict[str, Any]):
        c = from_dict(ServeConfig, cfg)
        self.model = serving_model(c)
        # One request's beams come as one item; a batch never splits them.
        self.embed_states.set_max_batch_size(max(c.state_batch_size, c.max_beam_width))
        self.embed_states.set_batch_wait_timeout_s(c.state_batch_wait_s)

    def info(self) -> dict[str, Any]:
        return {**self.model.info(), "model": to_dict(self.model.model_cfg), "max_positions": encoder_positions(self.model.qnet.action_encoder)}

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002, batch_size_fn=lambda items: sum(len(x) for x in items))
    async def embed_states(self, requests: list[list[np.ndarray]]) -> list[np.ndarray]:
        flat = [s for r in requests for s in r]
        vectors = await asyncio.to_thread(self.model.embed_states, flat)
        out, lo = [], 0
        for r in requests:
            out.append(vectors[lo : lo + len(r)])
            lo += len(r)
        return out

    async def embed_chunks(self, seqs: list[np.ndarray]) -> np.ndarray:
        return await asyncio.to_thread(self.model.embed_chunks, seqs)

    def stats(self) -> dict[str, Any]:
        return encoder_stats_of(self.model)


def encoder_stats_of(model) -> dict[str, Any]:
    """The encoder's work counters (GET /v1/encoder)."""
    return {"chunks_embedded": model.chunks_embedded, "states_embedded": model.states_embedded, "device": str(model.device)}


@serve.deployment(name="Shard", ray_actor_options={"num_cpus": 0}, **BACKEND_LIMITS)
class Shard:
    def __init__(self, cfg: dict[str, Any], slot: int):
        c = from_dict(ServeConfig, cfg)
        options = c.shard_options()
        self.holder = ShardHolder(CorpusStore(c.storage), slot, c.shard_holders(), pick_device(c.shard_device), options, c.shard_memory_bytes)
        # Loading a corpus from disk runs in its own threads: queries of loaded corpora never
        # wait behind it for a worker thread.
        self.loader = ThreadPoolExecutor(2, thread_name_prefix="qrag-load")

    async def topk(self, corpus: str, uid: str, version: int, states: np.ndarray, selected: list[list[int]], n_total: int, k: int):
        """("ok", ShardHits) | ("unhealthy", problems) | ("not_found", message) |
        ("over_budget", (corpus, need, budget)): plain data, so the ingress sees the reason
        whatever Ray does to exception types."""
        try:
            cs = self.holder.loaded(corpus, uid, version)
            if cs is None:  # load (or catch up) in the loader threads, never in the queries' way
                cs = await asyncio.get_running_loop().run_in_executor(self.loader, self.holder.ensure, corpus, uid, version)
            return "ok", await asyncio.to_thread(cs.topk, states, selected, n_total, k)
        except ShardUnhealthy as exc:
            return "unhealthy", [asdict(p) for p in exc.problems]
        except CorpusNotFound as exc:
            return "not_found", str(exc)
        except ShardOverBudget as exc:
            return "over_budget", (exc.corpus, exc.need, exc.budget)

    def stats(self, corpus: str | None = None) -> dict[str, Any]:
        return self.holder.stats(corpus)

    def forget(self, corpus: str) -> bool:
        return self.holder.forget(corpus)


def _overloaded(what: str, retry_after_s: int, why: str = "is overloaded or restarting") -> ServiceError:
    return ServiceError(503, None, f"{what} {why}; retry", {"Retry-After": str(retry_after_s)})


async def call_backend(method, args: tuple, what: str, timeout_s: float, retry_after_s: int):
    """One deployment-handle call with a deadline; every failure of the backend is a 503."""
    response = method.remote(*args)
    try:
        return await asyncio.wait_for(response, timeout_s)
    except asyncio.TimeoutError:
        response.cancel()
        raise _overloaded(what, retry_after_s, f"did not answer within {timeout_s:g} s (handle_timeout_s)") from None
    except (BackPressureError, DeploymentUnavailableError):
        raise _overloaded(what, retry_after_s) from None
    except RayError as exc:  # a dead replica, or an error inside it (CUDA out of memory, ...)
        cause = type(getattr(exc, "cause", None) or exc).__name__
        log.warning("%s failed: %s", what, exc)
        raise _overloaded(what, retry_after_s, f"failed ({cause})") from None


class RemoteEncoder:
    def __init__(self, handle, retry_after_s: int, timeout_s: float = 30.0):
        self.handle, self.retry_after_s, self.timeout_s = handle, retry_after_s, timeout_s

    async def _call(self, method: str, seqs):
        return await call_backend(getattr(self.handle, method), (seqs,), "the encoder", self.timeout_s, self.retry_after_s)

    async def embed_states(self, seqs):
        return await self._call("embed_states", seqs)

    async def embed_chunks(self, seqs):
        return await self._call("embed_chunks", seqs)


class RemoteShards:
    def __init__(self, handle, retry_after_s: int, timeout_s: float = 30.0):
        self.handle, self.retry_after_s, self.timeout_s = handle, retry_after_s, timeout_s

    async def topk(self, *args) -> ShardHits:
        status, payload = await call_backend(self.handle.topk, args, "an index shard", self.timeout_s, self.retry_after_s)
        if status == "unhealthy":
            raise ShardUnhealthy([SegmentProblem(**p) for p in payload])
        if status == "not_found":
            raise ServiceError(404, "corpus", payload)
        if status == "over_budget":
            raise ShardOverBudget(*payload)
        return payload

    async def stats(self, corpus: str | None = None) -> dict[str, Any]:
        return await call_backend(self.handle.stats, (corpus,), "an index shard", self.timeout_s, self.retry_after_s)

    async def forget(self, corpus: str) -> None:
        await call_backend(self.handle.forget, (corpus,), "an index shard", self.timeout_s, self.retry_after_s)


class RayMetrics:
    def __init__(self):
        self.requests = Counter("qrag_requests_total", description="HTTP requests by route and status.", tag_keys=("path", "status"))
        self.latency = Histogram("qrag_request_seconds", description="HTTP request latency.", boundaries=LATENCY_BOUNDS, tag_keys=("path",))
        self.stages = Histogram("qrag_retrieve_stage_seconds", description="Retrieval time per stage.", boundaries=LATENCY_BOUNDS, tag_keys=("stage",))
        self.indexed = Counter("qrag_chunks_indexed_total", description="Chunks embedded and stored.")

    def request(self, path: str, status: int, seconds: float) -> None:
        self.requests.inc(tags={"path": path, "status": str(status)})
        self.latency.observe(seconds, tags={"path": path})

    def stage(self, stage: str, seconds: float) -> None:
        self.stages.observe(seconds, tags={"stage": stage})

    def chunks_indexed(self, n: int) -> None:
        self.indexed.inc(n)


# The ingress builds its ASGI app after its (async) constructor, through the late-bound form of
# ``@serve.ingress()``: Serve calls ``__serve_build_asgi_app__`` on the replica once the
# constructor has run (documented in ray.serve.ingress). A builder function that reads a module
# global does not work: Serve pickles the decorated class by value, with its own copy of the
# module's globals, so the constructor and the builder would see two different dicts.
@serve.deployment(name=INGRESS, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=32, max_queued_requests=64)
@serve.ingress()
class Ingress:
    async def __init__(self, cfg: dict[str, Any], encoder, shards: list, static: dict[str, bytes]):
        """``encoder`` None (``colocate``): this replica holds the encoder and every shard itself."""
        c = from_dict(ServeConfig, cfg)
        self.keys = key_table(c.api_keys)  # $QRAG_API_KEYS of this replica (a Kubernetes Secret) + the config
        # The bind address comes from the config (our own record of http_options.host): Ray has no
        # public API for the proxy's host; unknown counts as public, so keys are then required.
        problem = startup_problem(c.http_host or "0.0.0.0", self.keys, c.allow_unauthenticated)
        if problem:
            raise RuntimeError(problem)
        self.metrics = RayMetrics()
        self.static = static
        self.encoder = encoder
        if encoder is None:
            self.model = await asyncio.to_thread(serving_model, c)
            self.service = local_service(c, self.model, str(pick_device(c.shard_device)), self.metrics)
            return
        info = await encoder.info.remote()
        source = serving_source(c)
        fingerprint, _, tokenizer, layout = await asyncio.to_thread(source_identity, source)
        if fingerprint != info["fingerprint"]:
            raise RuntimeError(f"the encoder serves model {info['fingerprint']} but {source.describe()} is {fingerprint}")
        identity = ModelIdentity(info["fingerprint"], from_dict(ModelConfig, info["model"]), info["dim"], info["source"], info["trained"],
                                 info.get("max_positions"))
        self.service = RetrievalService(c, CorpusStore(c.storage), Tokenization(tokenizer, layout, c.question_tokens), identity,
                                        RemoteEncoder(encoder, c.retry_after_s, c.handle_timeout_s),
                                        [RemoteShards(h, c.retry_after_s, c.handle_timeout_s) for h in shards], self.metrics)

    def __serve_build_asgi_app__(self):
        app = build_api(self.service, self.static, self.metrics.request, self.keys)
        cfg = self.service.cfg

        @app.api.get("/v1/encoder", include_in_schema=False)
        async def encoder_stats():  # work counters: the durability test checks nothing is re-embedded
            if self.encoder is None:
                return encoder_stats_of(self.model)
            return await call_backend(self.encoder.stats, (), "the encoder", cfg.handle_timeout_s, cfg.retry_after_s)

        return app


def _cluster_has_gpu() -> bool:
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def deployment_overrides(deployments: Sequence[Mapping[str, Any]] | None, shards: int) -> dict[str, dict[str, Any]]:
    """A Serve config's ``deployments:`` list -> {name: options}, checked: names of the app's
    deployments, keys and values Serve's DeploymentSchema and AutoscalingConfig accept (Serve
    itself ignores unknown keys, so a misspelt option would silently keep its default)."""
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema

    names = deployment_names(shards)
    out: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for i, entry in enumerate(deployments or []):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise ConfigError(f"deployments[{i}]: an entry needs a 'name' (one of {', '.join(names)})")
        at = f"deployments[{i}] ({entry['name']})"
        if entry["name"] not in names:
            app = "the colocated app" if shards == 0 else f"the app with {shards} shard deployment(s)"
            raise ConfigError(f"{at}: no deployment {entry['name']!r} in {app} (it has {', '.join(names)})")
        if entry["name"] in out:
            raise ConfigError(f"{at}: listed twice")
        problems += [f"{at}: unknown key {k!r}" for k in sorted(set(entry) - set(DeploymentSchema.model_fields))]
        auto = entry.get("autoscaling_config")
        if isinstance(auto, Mapping):
            problems += [f"{at}: autoscaling_config.{k}: unknown key" for k in sorted(set(auto) - set(AutoscalingConfig.model_fields))]
        try:
            DeploymentSchema.model_validate(dict(entry))
            if isinstance(auto, Mapping):
                AutoscalingConfig.model_validate(dict(auto))
        except ValidationError as exc:
            problems += [f"{at}: {'.'.join(map(str, e['loc'])) or 'autoscaling_config'}: {e['msg']}" for e in exc.errors()]
        out[entry["name"]] = {k: v for k, v in entry.items() if k != "name"}
    if problems:
        raise ConfigError("; ".join(problems))
    return out


def default_gpus(shards: int) -> dict[str, float]:
    """GPUs per replica when ``deployments:`` sets no ray_actor_options: half a GPU for the
    encoder and half shared by the shards when the cluster has a GPU, else none."""
    gpu = _cluster_has_gpu()
    return {ENCODER: 0.5 if gpu else 0.0, **{shard_name(i): (0.5 / shards if gpu else 0.0) for i in range(shards)}}


def build_app(cfg: ServeConfig, static: dict[str, bytes] | None = None, deployments: Sequence[Mapping[str, Any]] | None = None):
    """The Serve application: Ingress -> Encoder + Shard0..Shard{D-1} (D = ``shard_deployments``,
    by default one per shard). ``deployments`` (a Serve
    config's ``deployments:`` section) overrides each deployment's options, as Serve does when it
    deploys a config file: an entry's ``ray_actor_options`` replaces the default as a whole."""
    if cfg.shards < 1:
        raise ValueError(f"shards must be at least 1, got {cfg.shards}")
    holders = cfg.shard_holders()
    overrides = deployment_overrides(deployments, 0 if cfg.colocate else holders)
    gpus = default_gpus(holders)

    def options(deployment: str, **code: Any) -> dict[str, Any]:
        return {**code, **overrides.get(deployment, {})}

    args = to_dict(cfg)
    backpressure = {"status_code": 503, "retry_after_s": cfg.retry_after_s}
    if cfg.colocate:  # one replica holds the encoder and every shard: the GPU is its own
        whole = {"num_gpus": 1.0 if _cluster_has_gpu() else 0.0, "num_cpus": 0}
        return Ingress.options(**options(INGRESS, ray_actor_options=whole, backpressure_config=backpressure)).bind(args, None, [], static or {})
    encoder = Encoder.options(**options(ENCODER, ray_actor_options={"num_gpus": gpus[ENCODER], "num_cpus": 0})).bind(args)
    shards = [
        Shard.options(**options(shard_name(i), name=shard_name(i), ray_actor_options={"num_gpus": gpus[shard_name(i)], "num_cpus": 0})).bind(args, i)
        for i in range(holders)
    ]
    return Ingress.options(**options(INGRESS, backpressure_config=backpressure)).bind(args, encoder, shards, static or {})


def build_app_from_args(args: dict[str, Any] | None, static_dir) -> Any:
    """For ``serve run`` / ``serve deploy``: the config's ``args`` -> the application."""
    from qrag.serving.http_api import static_files

    return build_app(from_dict(ServeConfig, dict(args or {})), static_files(static_dir))


def serve_locally(cfg: ServeConfig, host: str, port: int, static_dir, deployments: Sequence[Mapping[str, Any]] | None = None) -> None:
    """``qrag serve``: start (or join, with $RAY_ADDRESS) Ray, run the app, block until Ctrl-C."""
    import os
    import signal
    import sys
    import time

    from qrag.serving.http_api import static_files

    try:
        keys = key_table(cfg.api_keys)
    except ApiKeyError as exc:
        raise SystemExit(f"qrag serve: {exc}") from None
    problem = startup_problem(host, keys, cfg.allow_unauthenticated)
    if problem:  # before Ray starts
        raise SystemExit(f"qrag serve: {problem}")
    deployment_overrides(deployments, 0 if cfg.colocate else cfg.shard_holders())  # unknown deployment names fail before Ray starts
    cfg = dataclasses.replace(cfg, http_host=host)  # what the ingress checks again on each replica

    def stop(signum, frame):  # SIGTERM (a service manager, `kill`) shuts down like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    # The HTTP proxy drops client headers that would lift the request timeout (the local Ray
    # started below inherits this; a running cluster needs it in `ray start`'s environment).
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", PROXY_CALLBACK)

    if os.environ.get("RAY_ADDRESS"):  # a running cluster, e.g. `ray start --head --node-ip-address=127.0.0.1`
        ray.init(configure_logging=False)
    else:  # a fresh local Ray, whatever else runs on this machine
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, configure_logging=False)
    try:
        serve.start(http_options={"host": host, "port": port, "request_timeout_s": cfg.request_timeout_s + 10})
        serve.run(build_app(cfg, static_files(static_dir), deployments), name="qrag", route_prefix="/")
        url = f"http://{host}:{port}"
        print(f"qrag serve: {url}/ (page)  {url}/docs (API)  {url}/healthz; model: {cfg.checkpoint or 'untrained ' + cfg.encoder}; "
              f"storage: {cfg.storage}; Ctrl-C stops", file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
