"""One front door for indexing: which path ``qrag index`` takes (lanes on this machine by default;
under a Ray cluster address the lanes on a GPU node, else Ray Data; ``--path`` and ``--lanes``
force one), the final JSON line naming it, the readers in qrag.data.records, and the lanes run as
a Ray task on a node of a local Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import qrag.index.lanes as lanes
from qrag.cli import main
from qrag.index.bulk import BulkIndexConfig, cluster_path, runs_here
from qrag.index.local import LocalIndex
from qrag.index.store import CorpusStore
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from test_bulk_index import ray_local  # noqa: F401 - the local Ray (loopback, 2 CPUs) of this module's Ray tests
from test_index import corpus_rows, make_documents

ROOT = Path(__file__).resolve().parents[1]
CHUNK_TOKENS = 24


def write_jsonl(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    return path


def argv_for(tmp_path: Path, tiny_encoder: str, *extra: str) -> list[str]:
    source = write_jsonl(tmp_path / "docs.jsonl", make_documents(6, seed=4))
    return [
        "index",
        "--corpus",
        "c",
        "--input",
        str(source),
        "--storage",
        str(tmp_path / "s"),
        "--encoder",
        tiny_encoder,
        "--chunk-tokens",
        str(CHUNK_TOKENS),
        "--shards",
        "2",
        "--no-progress",
        *extra,
    ]


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture
def machine(monkeypatch):
    """This machine's GPUs (``machine(n)``) and no Ray cluster address; the lanes and the Ray route
    replaced by recorders."""
    import torch

    import qrag.distributed.bulk_index as bulk_index

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    seen: dict = {}

    def fake_index_in_lanes(store, name, docs, cfg, devices, *, commit_chars, resume, on_commit):
        seen["lanes"] = devices
        return store.read(name), lanes.LaneStats()

    def fake_index_on_cluster(cfg, address, progress=None):
        seen["cluster"] = (cfg.path, address)
        return {"path": "ray", "devices": ["cpu"]}

    monkeypatch.setattr(lanes, "index_in_lanes", fake_index_in_lanes)
    monkeypatch.setattr(bulk_index, "index_on_cluster", fake_index_on_cluster)

    def gpus(n: int) -> dict:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        return seen

    return gpus


def test_by_default_the_lanes_run_on_every_gpu_of_this_machine(machine, tiny_encoder, tmp_path, capsys):
    seen = machine(2)
    assert main(argv_for(tmp_path, tiny_encoder)) == 0
    assert seen == {"lanes": ["cuda:0"] * 3 + ["cuda:1"] * 3}
    out = last_json(capsys)
    assert (out["path"], out["devices"]) == ("lanes", ["cuda:0", "cuda:1"])


def test_without_a_gpu_the_lanes_run_on_the_cpu(machine, tiny_encoder, tmp_path, capsys):
    seen = machine(0)
    assert main(argv_for(tmp_path, tiny_encoder)) == 0
    assert seen == {"lanes": ["cpu"]}
    assert last_json(capsys)["devices"] == ["cpu"]


def test_a_cluster_address_takes_the_ray_route(machine, tiny_encoder, tmp_path, monkeypatch, capsys):
    pytest.importorskip("ray")
    seen = machine(2)  # GPUs here too: under an address the cluster decides
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert main(argv_for(tmp_path, tiny_encoder)) == 0
    assert seen == {"cluster": ("auto", "10.0.0.1:6379")}
    assert last_json(capsys)["path"] == "ray"
    seen.clear()
    assert main(argv_for(tmp_path, tiny_encoder, "--address", "10.0.0.2:6379")) == 0  # the flag before the environment
    assert seen == {"cluster": ("auto", "10.0.0.2:6379")}
    capsys.readouterr()


def test_path_and_lanes_force_a_path(machine, tiny_encoder, tmp_path, monkeypatch, capsys):
    pytest.importorskip("ray")
    seen = machine(1)
    assert main(argv_for(tmp_path, tiny_encoder, "--path", "ray")) == 0  # Ray Data on a local Ray
    assert seen == {"cluster": ("ray", None)}
    seen.clear()
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert main(argv_for(tmp_path, tiny_encoder, "--path", "lanes")) == 0  # the lanes, on a node of that cluster
    assert seen == {"cluster": ("lanes", "10.0.0.1:6379")}
    seen.clear()
    assert main(argv_for(tmp_path, tiny_encoder, "--lanes", "cpu")) == 0  # --lanes: here, on those devices
    assert seen == {"lanes": ["cpu"]}
    capsys.readouterr()
    assert main(argv_for(tmp_path, tiny_encoder, "--lanes", "cpu", "--path", "ray")) == 2
    assert "does not go with --path ray" in capsys.readouterr().err


def test_the_rule_under_a_cluster_address():
    cfg = BulkIndexConfig(corpus="c", inputs=["x.jsonl"])
    assert runs_here(cfg, None) and not runs_here(cfg, "10.0.0.1:6379")
    assert (
        cluster_path(cfg, 8) == "lanes" and cluster_path(cfg, 0) == "ray"
    )  # GPU nodes: the lanes on one; else Ray Data
    lanes_cfg = BulkIndexConfig(corpus="c", inputs=["x.jsonl"], path="lanes")
    ray_cfg = BulkIndexConfig(corpus="c", inputs=["x.jsonl"], path="ray")
    assert cluster_path(lanes_cfg, 0) == "lanes" and cluster_path(ray_cfg, 8) == "ray"
    assert not runs_here(ray_cfg, None)  # Ray Data on a local Ray
    assert runs_here(BulkIndexConfig(corpus="c", inputs=["x.jsonl"], lanes="cpu"), "10.0.0.1:6379")


def test_the_default_indexes_end_to_end_in_lanes_on_the_cpu(tiny_encoder, tmp_path, monkeypatch, capsys):
    """No GPU, no address: ``qrag index`` with no path options makes the corpus in lanes on the CPU."""
    import torch

    from qrag import progress

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(progress, "_on", False)  # restored after: --progress turns the bars on for the process
    argv = argv_for(tmp_path, tiny_encoder, "--lane-workers", "1", "--commit-chunks", "8")
    assert main([*(a for a in argv if a != "--no-progress"), "--progress"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert (out["path"], out["devices"], out["corpus"]["documents"]) == ("lanes", ["cpu"], 6)
    assert "index c: 100%" in captured.err and "6/6" in captured.err  # the bar follows the lanes' commits


def test_the_readers_live_in_data_and_the_front_door_imports_no_ray():
    from qrag.data import records

    for name in (
        "FORMATS",
        "SUFFIXES",
        "WHOLE",
        "format_of",
        "expand_inputs",
        "text_doc_id",
        "plan_parts",
        "read_records",
        "read_documents",
        "count_documents",
    ):
        assert hasattr(records, name), name
    assert records.read_records.__module__ == "qrag.data.records"
    code = (
        "import sys, qrag.data.records, qrag.index.bulk, qrag.cli.index; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# On a local Ray


def reference_corpus(tiny_encoder: str, root: Path, docs) -> CorpusStore:
    store = CorpusStore(root)
    index = LocalIndex(store, load_embedding_model(resolve_source(None, tiny_encoder), "cpu"))
    index.create("c", chunk_tokens=CHUNK_TOKENS, shards=2)
    index.add_documents("c", docs)
    return store


@pytest.mark.ray
def test_the_lanes_run_as_a_task_on_a_node_of_the_cluster(ray_local, tiny_encoder, tmp_path, monkeypatch, capsys):
    """Under a cluster address with --path lanes (auto on a cluster with GPU nodes): one Ray task
    runs the lanes on its node (here without a GPU: num_gpus=0, the CPU); its commits stream back
    to the driver's log lines; the corpus is the one-process corpus."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # Ray is up already: the command joins it
    argv = argv_for(tmp_path, tiny_encoder, "--path", "lanes", "--lane-workers", "1", "--commit-chunks", "8")
    assert main([a for a in argv if a != "--no-progress"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    import ray

    assert (out["path"], out["devices"], out["node"]) == ("lanes", ["cpu"], ray.nodes()[0]["NodeManagerAddress"])
    assert out["lanes"]["commits"] >= 2 and captured.err.count("qrag index: c: +") == out["lanes"]["commits"]
    reference = reference_corpus(tiny_encoder, tmp_path / "one", make_documents(6, seed=4))
    rows, _, ids = corpus_rows(CorpusStore(tmp_path / "s"), "c")
    ref_rows, _, ref_ids = corpus_rows(reference, "c")
    assert (rows, ids) == (ref_rows, ref_ids)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "z", "body": "no text"}) + "\n")
    assert main([*argv, "--input", str(bad)]) == 2  # the task's error, as one line naming the record
    assert f"qrag index: error: {bad}: line 1.text: must be a string" in capsys.readouterr().err


@pytest.mark.ray
def test_a_cluster_without_gpus_indexes_through_ray_data(ray_local, tiny_encoder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert main(argv_for(tmp_path, tiny_encoder)) == 0
    out = last_json(capsys)
    assert (out["path"], out["devices"], out["corpus_documents"]) == ("ray", ["cpu"], 6)
