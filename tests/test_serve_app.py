"""The Ray Serve retriever end to end on 127.0.0.1: a relative-positions checkpoint, a
multi-document corpus in 2 shards, answers identical to the offline search, a bounded mixed
load of good and malformed requests, overload, a killed replica, Prometheus metrics, and the
web page driven in headless Chromium."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray.serve")

from qrag.checkpoint import load_qnet, save_checkpoint, untrained_qnet  # noqa: E402
from qrag.config import SearchConfig, load_config  # noqa: E402
from qrag.data.sample import Sample  # noqa: E402
from qrag.index.store import CorpusStore  # noqa: E402
from qrag.search import Retriever  # noqa: E402
from qrag.service_config import ServeConfig  # noqa: E402
from qrag.tokens import tokenize_samples  # noqa: E402

from test_index import make_documents  # noqa: E402

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
CHUNK_TOKENS = 24
QUESTIONS = [
    "who met the painter near the harbour", "where is the castle of the queen", "the ship and the lamp",
    "a film about the war", "the singer in the garden", "which king met the river", "novel of the forest", "the city lamp",
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

    sys.path.insert(0, str(ROOT))
    from serve.app import build  # what `serve run serve/config.yaml` imports

    port, metrics_port = free_port(), free_port()
    storage = tmp_path_factory.mktemp("serve") / "indexes"
    args = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())["applications"][0]["args"]
    args.update(checkpoint=str(checkpoint), storage=str(storage), shards=2, chunk_tokens=CHUNK_TOKENS,
                max_ongoing_requests=4, max_queued_requests=4, max_body_bytes=100_000, state_batch_wait_s=0.001)
    cfg = ServeConfig(**args)
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2, configure_logging=False,
             _metrics_export_port=metrics_port, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(args), name="qrag", route_prefix="/")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
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
        yield {"client": client, "url": f"http://127.0.0.1:{port}", "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
               "storage": storage, "checkpoint": checkpoint, "cfg": cfg}
    finally:
        serve.shutdown()
        ray.shutdown()


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
        tokd = tokenize_samples([Sample("c", question, chunks, [])], tok, layout, chunk_tokens=m.chunk_tokens, question_tokens=64)
        return retriever.retrieve(tokd, cfg)[0]

    run.chunks = chunks
    return run


def retrieve(client, **body):
    return client.post("/v1/retrieve", json={"corpus": "books", **body})


@pytest.mark.parametrize("search", [dict(max_steps=3), dict(max_steps=3, beam_width=3), dict(max_steps=4, stop_threshold=0.0)],
                         ids=["greedy", "beam", "threshold"])
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
    assert stats["documents"] == 16 and stats["shards"] == 2 and stats["chunks"] == len(offline.chunks) and stats["bytes"] > 0


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


def test_mixed_load_of_good_and_malformed_requests(app, offline):
    """>= 1000 requests, 4 at a time: every good answer is the offline answer, every bad one a 4xx."""
    expected = {q: offline(q, SearchConfig(max_steps=2)).selected for q in QUESTIONS}
    bad = bad_requests()
    rng = random.Random(0)
    plan = [("good", rng.choice(QUESTIONS)) for _ in range(450)] + [("bad", rng.randrange(len(bad))) for _ in range(560)]
    rng.shuffle(plan)
    outcomes = []

    async def main():
        limit = asyncio.Semaphore(4)
        async with httpx.AsyncClient(base_url=app["url"], timeout=120) as client:
            async def one(kind, what):
                async with limit:
                    if kind == "good":
                        r = await client.post("/v1/retrieve", json={"corpus": "books", "question": what, "max_steps": 2})
                        ok = r.status_code == 200 and [s["chunk_id"] for s in r.json()["steps"]] == expected[what]
                    else:
                        body, headers, status = bad[what]
                        r = await client.post("/v1/retrieve", content=body, headers=headers)
                        ok = r.status_code == status and r.json()["error"]["status"] == status
                    outcomes.append((kind, what, r.status_code, ok, r.text[:200]))

            await asyncio.gather(*(one(k, w) for k, w in plan))

    t0 = time.perf_counter()
    asyncio.run(main())
    seconds = time.perf_counter() - t0
    failures = [o for o in outcomes if not o[3]]
    assert len(outcomes) >= 1000 and not failures, failures[:5]
    print(f"mixed load: {len(outcomes)} requests in {seconds:.1f} s")


def test_overload_answers_503_with_retry_after_and_keeps_serving(app):
    context = " ".join(d.text for d in make_documents(40, seed=5))

    async def main():
        async with httpx.AsyncClient(base_url=app["url"], timeout=120) as client:
            slow = {"context": context, "question": "the painter", "max_steps": 8, "beam_width": 4}
            return await asyncio.gather(*(client.post("/v1/retrieve", json=slow) for _ in range(24)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
    assert all(r.headers.get("retry-after") == "1" for r in responses if r.status_code == 503)
    assert retrieve(app["client"], question=QUESTIONS[0]).status_code == 200


def test_killed_shard_replica_recovers_without_reembedding(app, offline):
    import ray

    client = app["client"]
    embedded = client.get("/v1/encoder").json()["chunks_embedded"]
    assert embedded >= len(offline.chunks)  # the corpus, plus the inline contexts of other tests
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
    assert client.get("/v1/encoder").json()["chunks_embedded"] == embedded  # nothing re-embedded
    holders = client.get("/v1/corpora/books").json()["shard_holders"]
    new = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Shard1#" in a["name"]]
    assert new and new != names
    assert holders[1]["loaded_rows"] == holders[1]["rows"] > 0  # the new replica read its rows from disk


def test_prometheus_metrics(app):
    client = app["client"]
    retrieve(client, question=QUESTIONS[2])
    deadline, text = time.time() + 60, ""
    while time.time() < deadline:
        try:
            text = httpx.get(app["metrics"], timeout=10).text
        except httpx.HTTPError:
            text = ""
        if "qrag_requests_total" in text and "qrag_retrieve_stage_seconds" in text:
            break
        time.sleep(2)
    assert "qrag_requests_total" in text and "qrag_retrieve_stage_seconds_bucket" in text and "qrag_chunks_indexed_total" in text


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
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chrome'}",
                 "--window-size=1280,1000"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(driver_bin), options=opts)


def test_web_page_in_headless_chromium(app, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    context = " ".join(d.text for d in make_documents(5, seed=9))
    question = "who met the singer near the lamp"
    api = httpx.post(f"{app['url']}/v1/retrieve", json={"context": context, "question": question, "max_steps": 3, "return_chunks": True}, timeout=60).json()
    driver = chromium_driver(tmp_path)
    try:
        driver.get(app["url"] + "/")
        wait = WebDriverWait(driver, 60)
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
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#corpus option")) == 1)
        driver.find_element(By.ID, "ask").click()
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-done") == "1"
                   and d.find_elements(By.CSS_SELECTOR, "#document .doc-head"))
        ref = retrieve(app["client"], question=question, max_steps=3).json()
        items = driver.find_elements(By.CSS_SELECTOR, "#steps > li.step")
        assert [int(li.get_attribute("data-chunk")) for li in items] == [s["chunk_id"] for s in ref["steps"]]
        # a bad request shows the server's message, naming the field
        driver.find_element(By.ID, "question").clear()
        driver.find_element(By.ID, "ask").click()
        wait.until(lambda d: "question" in d.find_element(By.ID, "status").text and "error" in d.find_element(By.ID, "status").get_attribute("class"))
        assert steps.is_displayed()
    finally:
        driver.quit()
