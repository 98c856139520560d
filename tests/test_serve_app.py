"""The Ray Serve retriever end to end on 127.0.0.1: a relative-positions checkpoint, a
multi-document corpus in 2 shards behind 2 ingress replicas with API keys, answers identical to
the offline search, hostile traffic (malformed input, strangers, floods of indexing jobs),
overload, a killed replica, Prometheus metrics, and the web page driven in headless Chromium."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray.serve")

from qrag.model.checkpoint import load_qnet, save_checkpoint, untrained_qnet  # noqa: E402
from qrag.config import SearchConfig, load_config  # noqa: E402
from qrag.data.sample import Sample  # noqa: E402
from qrag.distributed.serving import PROXY_CALLBACK  # noqa: E402
from qrag.index.store import CorpusStore  # noqa: E402
from qrag.retrieval.search import Retriever  # noqa: E402
from qrag.serving.service_config import ServeConfig  # noqa: E402
from qrag.data.tokens import tokenize_samples  # noqa: E402

from test_index import make_documents  # noqa: E402

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
CHUNK_TOKENS = 24
READ_KEY, WRITE_KEY = "serve-test-read-" + "r" * 16, "serve-test-write-" + "w" * 16
READ, WRITE = {"authorization": f"Bearer {READ_KEY}"}, {"authorization": f"Bearer {WRITE_KEY}"}
QUESTIONS = [
    "who met the painter near the harbour",
    "where is the castle of the queen",
    "the ship and the lamp",
    "a film about the war",
    "the singer in the garden",
    "which king met the river",
    "novel of the forest",
    "the city lamp",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tiny_encoder, tmp_path_factory) -> Path:
    """A checkpoint with relative RoPE positions: the served scores are the exact rotated ones."""
    cfg = load_config(None, [f"model.encoder={tiny_encoder}", "model.positions=relative"])
    qnet, tok, _ = untrained_qnet(cfg.model, torch.device("cpu"), use_target=False)
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "final", qnet, tok, cfg)


@pytest.fixture(scope="module")
def app(checkpoint, tmp_path_factory):
    import ray
    from ray import serve

    import yaml

    from qrag.distributed.serving import build_app
    from qrag.serving.http_api import static_files

    port, metrics_port = free_port(), free_port()
    storage = tmp_path_factory.mktemp("serve") / "indexes"
    config = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())["applications"][0]
    args = config["args"]
    # serve/config.yaml's deployments, as `serve run` applies them, with two ingress replicas and
    # small request limits (the overload tests), and the layout for corpora beyond one GPU: a
    # Shard deployment per shard (the fault test kills one of two). test_default_layout_*
    # deploys the shipped layout (the shards in the ingress) beside it.
    deployments = {d["name"]: d for d in config["deployments"]}
    deployments["Ingress"] = {"name": "Ingress", "num_replicas": 2, "max_ongoing_requests": 4, "max_queued_requests": 4}
    deployments.update({f"Shard{i}": {"name": f"Shard{i}", "num_replicas": 1} for i in range(2)})
    args.update(
        checkpoint=str(checkpoint),
        storage=str(storage),
        shards=2,
        shard_deployments=2,
        chunk_tokens=CHUNK_TOKENS,
        max_body_bytes=100_000,
        max_jobs=6,
        max_jobs_per_corpus=3,
        shard_memory_bytes=64 * 2**20,
        max_documents=500,
    )
    cfg = ServeConfig(**args)
    # The keys reach the replicas the way a Kubernetes Secret does: in their environment.
    saved = {k: os.environ.get(k) for k in ("QRAG_API_KEYS", "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH")}
    os.environ["QRAG_API_KEYS"] = f"{READ_KEY}:read,{WRITE_KEY}:write"
    os.environ["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] = PROXY_CALLBACK  # the proxy drops timeout-lifting headers
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=2,
        configure_logging=False,
        _metrics_export_port=metrics_port,
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port, "request_timeout_s": 60})
        serve.run(
            build_app(cfg, static_files(ROOT / "serve" / "static"), list(deployments.values())),
            name="qrag",
            route_prefix="/",
        )
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, headers=WRITE)
        docs = [{"id": d.id, "text": d.text} for d in make_documents(16)]
        assert client.post("/v1/corpora", json={"name": "books", "documents": docs[:10]}).status_code == 201
        r = client.post("/v1/corpora/books/documents", json={"documents": docs[10:], "wait": False})
        assert r.status_code == 202
        job = r.json()["job"]["id"]
        for _ in range(200):
            state = client.get(f"/v1/jobs/{job}").json()
            if state["state"] in ("done", "failed"):
                break
            time.sleep(0.05)
        assert state["state"] == "done" and state["progress"] == 1.0, state
        yield {
            "client": client,
            "url": f"http://127.0.0.1:{port}",
            "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
            "storage": storage,
            "checkpoint": checkpoint,
            "cfg": cfg,
        }
    finally:
        serve.shutdown()
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def offline(app):
    """The offline search over the same corpus, read as one long context in corpus order."""
    store = CorpusStore(app["storage"])
    m = store.read("books")
    rows = sorted(row for b in m.batches for s in range(m.shards) for row in store.read_texts(m, s, b))
    assert [p for p, _, _ in rows] == list(range(m.chunks))
    chunks = [t for _, _, t in rows]
    qnet, tok, layout, _ = load_qnet(app["checkpoint"], torch.device("cpu"), with_targets=False)
    retriever = Retriever(qnet, layout, torch.device("cpu"))

    def run(question: str, cfg: SearchConfig):
        tokd = tokenize_samples(
            [Sample("c", question, chunks, [])], tok, layout, chunk_tokens=m.chunk_tokens, question_tokens=64
        )
        return retriever.retrieve(tokd, cfg)[0]

    run.chunks = chunks
    return run


def retrieve(client, **body):
    return client.post("/v1/retrieve", json={"corpus": "books", **body})


@pytest.mark.parametrize(
    "search",
    [
        dict(max_steps=3),
        dict(max_steps=3, beam_width=3),
        dict(max_steps=3, beam_width=3, beam_score="logprob", beam_temperature=0.1),
        dict(max_steps=4, stop_threshold=0.0),
    ],
    ids=["greedy", "beam", "beam-logprob", "threshold"],
)
def test_served_answers_equal_offline_search(app, offline, search):
    client = app["client"]
    for question in QUESTIONS[:4]:
        r = retrieve(client, question=question, **search)
        assert r.status_code == 200, r.text
        body = r.json()
        ref = offline(question, SearchConfig(**search))
        assert [s["chunk_id"] for s in body["steps"]] == ref.selected
        assert [s["q"] for s in body["steps"]] == pytest.approx([s.q for s in ref.steps], abs=1e-5)
        assert [s["position"] for s in body["steps"]] == pytest.approx([s.position for s in ref.steps], abs=1e-5)
        assert all(s["text"] == offline.chunks[s["chunk_id"]] for s in body["steps"])
        assert body["stopped_early"] == ref.stopped_early
    health = client.get("/healthz").json()
    assert health["model"]["trained"] is True and health["model"]["positions"] == "relative"
    stats = client.get("/v1/corpora/books").json()
    assert (
        stats["documents"] == 16
        and stats["shards"] == 2
        and stats["chunks"] == len(offline.chunks)
        and stats["bytes"] > 0
    )


def test_serve_config_records_the_address_it_is_served_on():
    """What the refusal to serve a public address without keys is based on: the app's http_host
    must be Serve's http_options.host (Ray has no public API for the proxy's host)."""
    import yaml

    data = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    assert data["applications"][0]["args"]["http_host"] == data["http_options"]["host"]


def test_serve_config_deployments_are_the_apps_and_valid_for_serve():
    """Replicas, autoscaling, GPUs and request limits are Serve's per-deployment options in
    serve/config.yaml's deployments: section: Serve's own schema accepts them, every name is a
    deployment of the app, and `qrag serve --config` builds the app with the same options."""
    import argparse

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from qrag.cli.serve import serve_deployments
    from qrag.config import ConfigError
    from qrag.distributed.serving import build_app, deployment_names

    data = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(data)  # autoscaling_config fields included
    app = data["applications"][0]
    cfg = ServeConfig(**app["args"])
    names = [d["name"] for d in app["deployments"]]
    assert sorted(names) == sorted(deployment_names(cfg.shard_deployments)) == ["Ingress"]
    ingress = {d.name: d for d in schema.applications[0].deployments}["Ingress"]
    # A replica takes a full round's worth of requests; the replica count follows the GPUs.
    assert ingress.max_ongoing_requests >= cfg.state_batch_size and "num_replicas" not in app["deployments"][0]
    args = argparse.Namespace(config=str(ROOT / "serve" / "config.yaml"))
    assert serve_deployments(args) == app["deployments"]
    build_app(cfg, {}, app["deployments"])  # Deployment.options accepts every option (Serve validates them there)
    assert cfg.shards == 2 and cfg.shard_deployments == 0  # the shipped layout: the Ingress holds both shards
    with pytest.raises(ConfigError, match="no deployment 'Shard0' in the app with its shards in the Ingress"):
        build_app(cfg, {}, [{"name": "Shard0", "num_replicas": 1}])
    with pytest.raises(Exception, match="target_ongoing_request"):
        build_app(cfg, {}, [{"name": "Ingress", "autoscaling_config": {"target_ongoing_request": 2}}])


def test_fewer_shard_deployments_each_hold_several_shards(tmp_path, tiny_encoder):
    """shard_deployments: D deployments hold the shards i, i + D, ... (one per GPU scores its shards
    in one pass); the app has exactly D shard deployments, and the in-process service D holders."""
    from qrag.config import ConfigError
    from qrag.distributed.serving import build_app
    from qrag.serving.service import local_service

    cfg = ServeConfig(storage=str(tmp_path / "idx"), shards=4, shard_deployments=1)
    assert (
        cfg.shard_holders() == 1
        and ServeConfig(shards=4).shard_holders() == 1
        and ServeConfig(shards=4, shard_deployments=4).shard_holders() == 4
    )
    build_app(cfg, {}, [{"name": "Shard0", "num_replicas": 1}])
    with pytest.raises(ConfigError, match="no deployment 'Shard1'"):
        build_app(cfg, {}, [{"name": "Shard1", "num_replicas": 1}])
    with pytest.raises(ValueError, match="shard_deployments must be between 0 and shards"):
        ServeConfig(shards=2, shard_deployments=3).shard_holders()

    from qrag.retrieval.embedder import load_embedding_model, resolve_source

    service = local_service(cfg, load_embedding_model(resolve_source(None, tiny_encoder), "cpu"))
    assert len(service.holders) == 1 and service.holders[0].holder.holders == 1


def bad_requests() -> list[tuple[bytes, dict[str, str], int]]:
    """(body, headers, expected status) of malformed requests."""
    j = {"content-type": "application/json"}
    cases = [
        (json.dumps({"corpus": "books", "question": ""}).encode(), j, 422),
        (json.dumps({"corpus": "books", "question": "q" * 5000}).encode(), j, 422),
        (json.dumps({"corpus": "nope", "question": "q"}).encode(), j, 404),
        (json.dumps({"corpus": "books", "question": "q", "max_steps": 0}).encode(), j, 422),
        (json.dumps({"corpus": "books", "question": "q", "max_steps": 1000}).encode(), j, 422),
        (json.dumps({"corpus": "books", "question": "q", "beam_width": "wide"}).encode(), j, 422),
        (json.dumps({"corpus": "books", "question": ["q"]}).encode(), j, 422),
        (json.dumps({"corpus": "books", "question": "q", "stop_threshold": "low"}).encode(), j, 422),
        (json.dumps({"corpus": "books", "question": "q", "unknown": True}).encode(), j, 422),
        (json.dumps({"question": "q"}).encode(), j, 422),
        (b'{"corpus": "books", "question": ', j, 400),
        (b'{"corpus": "books", "question": "\xff\xfe"}', j, 400),
        (json.dumps({"corpus": "books", "question": "x" * 120_000}).encode(), j, 413),
        (b"question=q", {"content-type": "application/x-www-form-urlencoded"}, 415),
    ]
    return cases


def hostile_requests() -> list[tuple[str, str, bytes, dict[str, str], set[int]]]:
    """(method, path, body, headers, allowed statuses) of the hostile classes of issue 13."""
    j = {"content-type": "application/json"}
    r, w = {**j, **READ}, {**j, **WRITE}

    def post(path, payload, headers, *statuses):
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return ("POST", path, body, headers, set(statuses))

    tiny_docs = {"documents": [{"id": str(i), "text": "a"} for i in range(1200)]}
    cases = [post("/v1/retrieve", body, {**headers, **READ}, status) for body, headers, status in bad_requests()]
    cases += [
        post(
            "/v1/retrieve", f'{{"corpus": "books", "question": "q", "stop_threshold": 1{"0" * 400}}}'.encode(), r, 422
        ),
        post("/v1/retrieve", b'{"corpus": "books", "question": "q", "stop_threshold": 1e400}', r, 422),
        post("/v1/retrieve", {"context": "A short text. Another one.", "question": "q", "chunk_tokens": 512}, r, 422),
        post("/v1/retrieve", {"context": "w" * 30_000, "question": "q"}, r, 422),
        post("/v1/retrieve", {"corpus": "books\n", "question": "q"}, r, 422),
        post("/v1/retrieve", {"corpus": "books", "question": "q"}, j, 401),
        post("/v1/retrieve", {"corpus": "books", "question": "q"}, {**j, "authorization": "Bearer guessed-key"}, 401),
        post("/v1/corpora", {"name": "intruder", "documents": [{"id": "x", "text": "Poison."}]}, j, 401),
        post("/v1/corpora", {"name": "intruder", "documents": [{"id": "x", "text": "Poison."}]}, r, 403),
        post("/v1/corpora", b'{"name": "intruder"}', WRITE, 415),
        post("/v1/corpora", b"name=intruder", {**WRITE, "content-type": "application/x-www-form-urlencoded"}, 415),
        post("/v1/corpora", b'{"name": "intruder"}', {**WRITE, "content-type": "text/plain"}, 415),
        post("/v1/corpora", {"name": "intruder"}, {**w, "origin": "http://evil.example"}, 403),
        post("/v1/corpora", {"name": "books\n"}, w, 422),
        post("/v1/corpora", {"name": "c511", "chunk_tokens": 511}, w, 422),
        post("/v1/corpora", {"name": "books"}, w, 409),
        post("/v1/corpora/books/reindex", {}, r, 403),
        post("/v1/corpora/books/reindex", b"", WRITE, 415),
        post("/v1/corpora/flood/documents", b'{"documents": [{"id": "s\\ud800", "text": "A text."}]}', w, 422),
        post("/v1/corpora/flood/documents", b'{"documents": [{"id": "n\\u0000", "text": "A text."}]}', w, 422),
        post("/v1/corpora/flood/documents", {"documents": [{"id": "long", "text": "z" * 30_000}]}, w, 422),
        post("/v1/corpora/flood/documents", tiny_docs, w, 413),
        post("/v1/corpora/nope/documents", {"documents": [{"id": "d", "text": "A text."}]}, w, 404),
        ("DELETE", "/v1/corpora/books", b"", {}, {401}),
        ("DELETE", "/v1/corpora/books", b"", READ, {403}),
        ("GET", "/v1/corpora", b"", {**READ, "host": "evil.example"}, {421}),
        ("GET", "/v1/corpora/nope", b"", READ, {404}),
        ("GET", "/v1/jobs/0123456789abcdef", b"", READ, {404}),
        ("GET", "/v1/jobs/..%2F..%2Fetc", b"", READ, {404}),
    ]
    return cases


def _replica_rss() -> int:
    """Resident memory of the app's Serve replicas (ingress, encoder, shards)."""
    import psutil

    total = 0
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any("ServeReplica:qrag" in part for part in proc.info["cmdline"] or []):
                total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def test_hostile_traffic_against_two_ingress_replicas(app, offline):
    """>= 1000 requests, 6 at a time, against 2 ingress replicas: good retrievals (also with a
    header that tries to lift the timeout) equal the offline answers; every hostile class of
    issue 13 gets its 4xx; floods of wait:false appends, wait:true appends and re-indexes get
    202/200 or 429/409; every job id answers on every replica and ends done or failed with a
    reason; no 5xx but 503; replica memory stays bounded; both corpora are whole afterwards."""
    client = app["client"]
    assert (
        client.post(
            "/v1/corpora",
            json={"name": "flood", "documents": [{"id": "seed", "text": "The seed document. It is short."}]},
        ).status_code
        == 201
    )
    expected = {q: offline(q, SearchConfig(max_steps=2)).selected for q in QUESTIONS}
    hostile = hostile_requests()
    rng = random.Random(13)
    plan = (
        [("good", rng.choice(QUESTIONS)) for _ in range(420)]
        + [("hostile", rng.randrange(len(hostile))) for _ in range(430)]
        + [("append", i) for i in range(110)]
        + [("append_wait", i) for i in range(30)]
        + [("reindex", i) for i in range(40)]
    )
    rng.shuffle(plan)
    plan += [("poll", i) for i in range(60)]  # after the floods, jobs are asked for on any replica
    rss_before = _replica_rss()
    outcomes, jobs, acked = [], {}, set()

    async def main():
        limit = asyncio.Semaphore(6)
        async with httpx.AsyncClient(base_url=app["url"], timeout=120) as c:

            async def one(kind, what):
                async with limit:
                    ok = False
                    if kind == "good":
                        headers = {**READ, "x-request-timeout-seconds": "0"} if what == QUESTIONS[0] else READ
                        r = await c.post(
                            "/v1/retrieve", json={"corpus": "books", "question": what, "max_steps": 2}, headers=headers
                        )
                        ok = (
                            r.status_code == 200 and [s["chunk_id"] for s in r.json()["steps"]] == expected[what]
                        ) or r.status_code == 503
                    elif kind == "hostile":
                        method, path, body, headers, allowed = hostile[what]
                        r = await c.request(method, path, content=body or None, headers=headers)
                        ok = r.status_code in allowed and r.json()["error"]["status"] == r.status_code
                    elif kind in ("append", "append_wait"):
                        docs = [
                            {
                                "id": f"{kind}-{what}-{k}",
                                "text": f"Flood document {what} part {k}. The {QUESTIONS[k % 8]}.",
                            }
                            for k in range(2)
                        ]
                        r = await c.post(
                            "/v1/corpora/flood/documents",
                            json={"documents": docs, "wait": kind == "append_wait"},
                            headers=WRITE,
                        )
                        ok = r.status_code in (200, 202, 429, 503)
                        if r.status_code in (200, 202):
                            jobs[r.json()["job"]["id"]] = [d["id"] for d in docs]
                        if r.status_code == 200:
                            acked.update(d["id"] for d in docs)
                    elif kind == "reindex":
                        r = await c.post("/v1/corpora/flood/reindex", json={}, headers=WRITE)
                        ok = r.status_code in (202, 409, 429, 503)
                        if r.status_code == 202:
                            jobs[r.json()["job"]["id"]] = []
                    else:  # poll a job this test was given, whichever replica answers
                        ids = sorted(jobs)
                        r = await c.get(f"/v1/jobs/{ids[what % len(ids)]}", headers=READ)
                        ok = (
                            r.status_code == 200 and r.json()["state"] in ("queued", "running", "done", "failed")
                        ) or r.status_code == 503
                    if r.status_code == 503:
                        ok = ok and r.headers.get("retry-after") is not None
                    if r.status_code == 503 and "backpressure" in r.text:
                        ok = True  # Serve's own queue bound (max_queued_requests), before the app sees the request
                    outcomes.append((kind, what, r.status_code, ok, r.text[:200]))

            await asyncio.gather(*(one(k, w) for k, w in plan if k != "poll"))
            await asyncio.gather(*(one(k, w) for k, w in plan if k == "poll"))

    t0 = time.perf_counter()
    asyncio.run(main())
    seconds = time.perf_counter() - t0
    failures = [o for o in outcomes if not o[3]]
    assert len(outcomes) >= 1000 and not failures, failures[:5]
    assert not [o for o in outcomes if o[2] >= 500 and o[2] != 503]
    codes = {}
    for kind, _, status, _, _ in outcomes:
        codes.setdefault(kind, {}).setdefault(status, 0)
        codes[kind][status] += 1
    assert codes["good"].get(200, 0) >= 0.9 * sum(codes["good"].values()), codes["good"]
    assert codes["append"].get(202) and codes["append"].get(429), codes["append"]  # admitted, then bounded
    assert codes["poll"].get(200, 0) >= 0.8 * sum(codes["poll"].values()) and not codes["poll"].get(404), codes["poll"]

    # Every job ends, with a reason when it failed; no job is stuck "running".
    deadline, final = time.time() + 180, {}
    while time.time() < deadline and len(final) < len(jobs):
        for job_id in set(jobs) - set(final):
            state = client.get(f"/v1/jobs/{job_id}").json()
            if state["state"] in ("done", "failed"):
                final[job_id] = state
        time.sleep(0.2)
    assert len(final) == len(jobs), f"{len(jobs) - len(final)} jobs never ended"
    assert all(s["error"] and s["error"]["message"] for s in final.values() if s["state"] == "failed")
    done_docs = {d for job_id, docs in jobs.items() if final[job_id]["state"] == "done" for d in docs}
    failed_docs = {d for job_id, docs in jobs.items() if final[job_id]["state"] == "failed" for d in docs}
    assert acked <= done_docs

    # The corpora are whole: exactly the documents of finished jobs, every file intact.
    store = CorpusStore(app["storage"])
    m = store.read("flood")
    ids = set(store.doc_ids(m))
    assert ids == {"seed"} | done_docs and not ids & failed_docs
    assert all(store.read_segment(m, s, b)[1] is None for b in m.batches for s in range(m.shards))
    assert client.post("/v1/retrieve", json={"corpus": "flood", "question": QUESTIONS[1]}).status_code == 200
    for q in QUESTIONS[:3]:
        assert [s["chunk_id"] for s in retrieve(client, question=q, max_steps=2).json()["steps"]] == expected[q]
    assert client.get("/v1/corpora/books").json()["documents"] == 16
    growth = _replica_rss() - rss_before
    assert growth < 600 * 2**20, f"replicas grew by {growth / 2**20:.0f} MiB"
    print(
        f"hostile traffic: {len(outcomes)} requests in {seconds:.1f} s; {len(jobs)} jobs "
        f"({sum(s['state'] == 'done' for s in final.values())} done); "
        f"replica RSS {growth / 2**20:+.0f} MiB; codes {codes}"
    )


def test_overload_answers_503_with_retry_after_and_keeps_serving(app):
    context = " ".join(d.text for d in make_documents(40, seed=5))

    async def main():
        async with httpx.AsyncClient(base_url=app["url"], timeout=120, headers=READ) as client:
            slow = {"context": context, "question": "the painter", "max_steps": 8, "beam_width": 4}
            return await asyncio.gather(*(client.post("/v1/retrieve", json=slow) for _ in range(24)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
    assert all(r.headers.get("retry-after") == "1" for r in responses if r.status_code == 503)
    assert retrieve(app["client"], question=QUESTIONS[0]).status_code == 200


def test_default_layout_answers_as_the_shard_deployments(app, offline):
    """The shipped layout (shard_deployments: 0): the Ingress holds the encoder and both shards
    (no handle call per query), loads the stored corpus at start, steps concurrent requests
    together, and gives the offline search's answers with nothing re-embedded."""
    from ray import serve

    from qrag.distributed.serving import build_app

    cfg = dataclasses.replace(app["cfg"], shard_deployments=0)
    serve.run(build_app(cfg, {}, [{"name": "Ingress", "num_replicas": 1}]), name="inprocess", route_prefix="/inprocess")
    try:
        client = httpx.Client(base_url=app["url"] + "/inprocess", timeout=120, headers=READ)
        for question in QUESTIONS[:3]:
            for search in (dict(max_steps=3), dict(max_steps=3, beam_width=3)):
                r = client.post("/v1/retrieve", json={"corpus": "books", "question": question, **search})
                assert r.status_code == 200, r.text
                ref = offline(question, SearchConfig(**search))
                assert [s["chunk_id"] for s in r.json()["steps"]] == ref.selected
                assert [s["q"] for s in r.json()["steps"]] == pytest.approx([s.q for s in ref.steps], abs=1e-5)
        stats = client.get("/v1/encoder").json()
        assert stats["chunks_embedded"] == 0 and stats["states_embedded"] > 0  # the corpus was read from disk
        holders = client.get("/v1/corpora/books").json()["shard_holders"]
        assert len(holders) == 1 and holders[0]["loaded_rows"] == holders[0]["rows"] == len(offline.chunks)

        async def together():
            async with httpx.AsyncClient(base_url=app["url"] + "/inprocess", timeout=120, headers=READ) as c:
                return await asyncio.gather(
                    *(
                        c.post("/v1/retrieve", json={"corpus": "books", "question": q, "max_steps": 3})
                        for q in QUESTIONS
                    )
                )

        before = client.get("/v1/encoder").json()
        answers = asyncio.run(together())
        after = client.get("/v1/encoder").json()
        for q, r in zip(QUESTIONS, answers):
            assert [s["chunk_id"] for s in r.json()["steps"]] == offline(q, SearchConfig(max_steps=3)).selected
        # Eight concurrent 3-step requests took fewer rounds than eight alone (24).
        assert after["rows"] - before["rows"] == 24 and after["rounds"] - before["rounds"] < 24
        assert client.get("/v1/retrieve", headers={}).status_code in (401, 405)  # the same guarded API
    finally:
        serve.delete("inprocess")


def test_default_replicas_share_each_gpu(monkeypatch):
    """Unset in deployments:, the Ingress runs replicas_per_gpu replicas on every GPU, each with
    that share of a GPU; one replica and no GPU on a cluster without GPUs; an autoscaling_config
    keeps Serve in charge of the count."""
    import qrag.distributed.serving as serving

    cfg = ServeConfig(storage="unused", replicas_per_gpu=2)
    monkeypatch.setattr(serving, "_cluster_gpus", lambda: 2)
    assert serving.default_ingress_replicas(cfg) == 4 and serving.default_gpus(0, 2) == {"Ingress": 0.5}
    app = serving.build_app(cfg, {}, [])
    assert app._bound_deployment._deployment_config.num_replicas == 4
    scaled = serving.build_app(
        cfg, {}, [{"name": "Ingress", "autoscaling_config": {"min_replicas": 1, "max_replicas": 8}}]
    )
    assert scaled._bound_deployment._deployment_config.autoscaling_config is not None
    assert serving.default_ingress_replicas(dataclasses.replace(cfg, shard_deployments=2)) == 1
    monkeypatch.setattr(serving, "_cluster_gpus", lambda: 0)
    assert serving.default_ingress_replicas(cfg) == 1 and serving.default_gpus(0, 2) == {"Ingress": 0.0}


def test_default_layout_has_the_ingress_only():
    from qrag.config import ConfigError
    from qrag.distributed.serving import build_app

    cfg = ServeConfig(storage="unused", shards=2)
    build_app(cfg, {}, [{"name": "Ingress", "num_replicas": 2}])
    with pytest.raises(ConfigError, match="no deployment 'Shard0' in the app with its shards in the Ingress"):
        build_app(cfg, {}, [{"name": "Shard0", "num_replicas": 1}])


def chunks_embedded(client, replicas: int = 2) -> dict[str, int]:
    """Chunks embedded by each ingress replica (each holds its own encoder), asked until all answered."""
    seen: dict[str, int] = {}
    for _ in range(50):
        stats = client.get("/v1/encoder").json()
        seen[stats["replica"]] = stats["chunks_embedded"]
        if len(seen) == replicas:
            return seen
    raise AssertionError(f"only {len(seen)} of {replicas} ingress replicas answered")


def test_killed_shard_replica_recovers_without_reembedding(app, offline):
    import ray

    client = app["client"]
    embedded = chunks_embedded(client)
    assert sum(embedded.values()) >= len(offline.chunks)  # the corpus, plus the inline contexts of other tests
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Shard1#" in a["name"]]
    assert len(names) == 1
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    ref = offline(QUESTIONS[1], SearchConfig(max_steps=3))
    deadline, seen = time.time() + 90, []
    while time.time() < deadline:
        r = retrieve(client, question=QUESTIONS[1], max_steps=3)
        seen.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text  # a shard restarting is an overload, not an error
        time.sleep(0.5)
    assert r.status_code == 200, seen
    assert [s["chunk_id"] for s in r.json()["steps"]] == ref.selected
    assert chunks_embedded(client) == embedded  # nothing re-embedded, by either ingress replica
    holders = client.get("/v1/corpora/books").json()["shard_holders"]
    new = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Shard1#" in a["name"]]
    assert new and new != names
    assert holders[1]["loaded_rows"] == holders[1]["rows"] > 0  # the new replica read its rows from disk


GUARDED = ("401", "403", "413", "415", "421")


def test_prometheus_metrics(app):
    client = app["client"]
    retrieve(client, question=QUESTIONS[2])
    client.post("/v1/retrieve", content=b"{}", headers={"content-type": "text/plain"})  # 415
    client.post("/v1/corpora", json={"name": "x"}, headers={"authorization": "Bearer wrong"})  # 401
    client.post("/v1/corpora", json={"name": "x"}, headers=READ)  # 403
    client.get("/v1/corpora", headers={"host": "evil.example"})  # 421
    client.post("/v1/retrieve", json={"context": "x " * 60_000, "question": "q"})  # 413 from BodyGuard
    deadline, text = time.time() + 60, ""
    while time.time() < deadline:
        try:
            text = httpx.get(app["metrics"], timeout=10).text
        except httpx.HTTPError:
            text = ""
        counted = [line for line in text.splitlines() if "qrag_requests_total{" in line]
        if "qrag_retrieve_stage_seconds" in text and all(
            any(f'status="{s}"' in line for line in counted) for s in GUARDED
        ):
            break
        time.sleep(2)
    assert (
        "qrag_requests_total" in text
        and "qrag_retrieve_stage_seconds_bucket" in text
        and "qrag_chunks_indexed_total" in text
    )
    counted = [line for line in text.splitlines() if "qrag_requests_total{" in line]
    for status in GUARDED:  # the guards' refusals are counted too
        assert any(f'status="{status}"' in line for line in counted), status


def chromium_driver(tmp_path):
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_bin):
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium and chromium-driver (.ci/run does)")
        pytest.skip("chromium / chromedriver not installed (apt-get install -y chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # never let Selenium Manager download anything
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chrome'}",
        "--window-size=1280,1000",
    ):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(driver_bin), options=opts)


def test_web_page_in_headless_chromium(app, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    context = " ".join(d.text for d in make_documents(5, seed=9))
    question = "who met the singer near the lamp"
    api = httpx.post(
        f"{app['url']}/v1/retrieve",
        json={"context": context, "question": question, "max_steps": 3, "return_chunks": True},
        headers=READ,
        timeout=60,
    ).json()
    driver = chromium_driver(tmp_path)
    try:
        driver.get(app["url"] + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(
            lambda d: "model hidden" in d.find_element(By.ID, "model").text
        )  # keys set: no details for strangers
        driver.find_element(By.ID, "api-key").send_keys(READ_KEY)  # typing the key asks again, no blur needed
        wait.until(lambda d: "positions relative" in d.find_element(By.ID, "model").text)
        driver.execute_script("document.getElementById('context').value = arguments[0];", context)
        driver.find_element(By.ID, "question").send_keys(question)
        steps = driver.find_element(By.ID, "max-steps")
        driver.execute_script("arguments[0].value = '3';", steps)
        driver.find_element(By.ID, "ask").click()
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-done") == "1")
        items = driver.find_elements(By.CSS_SELECTOR, "#steps > li.step")
        assert [int(li.get_attribute("data-chunk")) for li in items] == [s["chunk_id"] for s in api["steps"]]
        chosen = driver.find_elements(By.CSS_SELECTOR, "#document .chunk.chosen")
        assert sorted(int(c.get_attribute("data-chunk")) for c in chosen) == sorted(s["chunk_id"] for s in api["steps"])
        assert len(driver.find_elements(By.CSS_SELECTOR, "#document .chunk")) == api["n_chunks"]
        assert [b.text for b in driver.find_elements(By.CSS_SELECTOR, "#document .chunk.chosen .badge")] != []
        driver.save_screenshot(str(tmp_path / "page.png"))
        # the indexed corpus, chosen from the list
        driver.find_element(By.ID, "use-corpus").click()
        # other tests of this module may have indexed more corpora: pick "books" from the list
        wait.until(
            lambda d: any(
                o.get_attribute("value") == "books" for o in d.find_elements(By.CSS_SELECTOR, "#corpus option")
            )
        )
        driver.execute_script("document.getElementById('corpus').value = 'books';")
        driver.find_element(By.ID, "ask").click()
        wait.until(
            lambda d: (
                d.find_element(By.TAG_NAME, "body").get_attribute("data-done") == "1"
                and d.find_elements(By.CSS_SELECTOR, "#document .doc-head")
            )
        )
        ref = retrieve(app["client"], question=question, max_steps=3).json()
        items = driver.find_elements(By.CSS_SELECTOR, "#steps > li.step")
        assert [int(li.get_attribute("data-chunk")) for li in items] == [s["chunk_id"] for s in ref["steps"]]
        # a bad request shows the server's message, naming the field
        driver.find_element(By.ID, "question").clear()
        driver.find_element(By.ID, "ask").click()
        wait.until(
            lambda d: (
                "question" in d.find_element(By.ID, "status").text
                and "error" in d.find_element(By.ID, "status").get_attribute("class")
            )
        )
        assert steps.is_displayed()
    finally:
        driver.quit()
