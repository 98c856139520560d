"""bench/faiss_gpu.py (FAISS against the shards' torch scoring) as a CPU smoke run: FAISS's CPU
indexes, the shards' own path, the same picks. On the GPU machines it runs through
bench/faiss_gpu.sh with the CUDA-12 build."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from test_serve_http_bench import ROOT, run

pytest.importorskip("faiss")


def test_faiss_and_the_shards_pick_the_same_chunks(tmp_path):
    out = tmp_path / "faiss.json"
    run("faiss_gpu.py", "--device", "cpu", "--chunks", "3000", "--states", "1,4", "--repeats", "2", "--out", str(out))
    result = json.loads(out.read_text())
    assert [(r["chunks"], r["states"]) for r in result["rows"]] == [(3000, 1), (3000, 4)]
    for row in result["rows"]:
        assert row["agreement_with_torch"] == {"faiss_flat": 1.0, "faiss_flat_fp16": 1.0, "faiss_one_index": 1.0}
        assert row["torch_ms"] > 0 and row["faiss_flat_ms"] > 0 and 0 <= row["faiss_ivf_recall"] <= 1
    assert result["device"] == "cpu" and result["commit"]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler")
def test_the_cublas_stand_in_exports_cuda_12s_versioned_names(tmp_path):
    """bench/cublas12/: FAISS's cuBLAS calls are bound to version node libcublas.so.12."""
    out = subprocess.run(
        ["bash", str(ROOT / "bench" / "cublas12" / "build.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    lib = tmp_path / "libcublas.so.12"
    assert out.stdout.strip() == str(tmp_path) and lib.exists() and (tmp_path / "libcublasLt.so.12").exists()
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    for name in (
        "cublasCreate_v2",
        "cublasSetStream_v2",
        "cublasGemmEx",
        "cublasSgemmEx",
        "cublasGemmStridedBatchedEx",
    ):
        assert f"{name}@@libcublas.so.12" in symbols


def test_the_candidate_stage_bench_measures_recall_against_exact_scoring(tmp_path):
    """bench/ann_gpu.py on the CPU: every row's recall is measured against the shards' exact path."""
    out = tmp_path / "ann.json"
    run(
        "ann_gpu.py", "--device", "cpu", "--chunks", "4000", "--dim", "32", "--kinds", "ivf_flat",
        "--nprobes", "64", "--probes", "8", "--candidates", "64", "--states", "1,4", "--eval-states", "8",
        "--repeats", "1", "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    rows = {(r["positions"], r["probes_per_segment"]): r for r in result["rows"]}
    assert set(rows) == {("relative", 8), ("none", 1)}
    assert rows[("none", 1)]["recall_at_k"] == 1.0  # 64 of 64 lists searched: exact
    assert rows[("relative", 8)]["recall_at_k"] >= 0.8
    assert set(rows[("relative", 8)]["ms"]) == {"1", "4"} and result["commit"]


def test_only_the_call_carrying_the_last_wheel_part_runs_the_benches(tmp_path):
    """On a warm machine that kept every part, the calls carrying parts 1 and 2 keep them and stop
    (they used to start the benches, which their time limits then cut off); the third goes on."""
    import hashlib

    wheel, data = "faiss_gpu-0-py3-none-any.whl", b"0123456789"
    parts = tmp_path / "parts"
    parts.mkdir()
    manifest = f"wheel={wheel}\nparts=3\nsha256={hashlib.sha256(data).hexdigest()}\n"
    for i in range(3):
        (parts / f"{wheel}.part{i}").write_bytes(data[i * 4 : (i + 1) * 4])
    (parts / "manifest").write_text(manifest)

    def call(n: int) -> subprocess.CompletedProcess:
        tree = tmp_path / f"tree{n}"
        carried = tree / ".carry" / f"faiss_{n}"
        carried.mkdir(parents=True)
        (carried / f"{wheel}.part{n - 1}").write_bytes((parts / f"{wheel}.part{n - 1}").read_bytes())
        (carried / "manifest").write_text(manifest)
        return subprocess.run(
            ["bash", str(ROOT / "bench" / "faiss_gpu.sh")],
            cwd=tree,
            env={"PATH": "/usr/bin:/bin", "PARTS": str(parts), "OUT": str(tmp_path / "out"), "PY": "false"},
            capture_output=True,
            text=True,
            timeout=60,
        )

    for n in (1, 2):
        done = call(n)
        assert done.returncode == 0 and "the call carrying the last part runs" in done.stdout
    last = call(3)  # joins and checks the wheel, then fails installing it here (no real wheel): it went on
    assert (parts / wheel).read_bytes() == data
    assert "the call carrying the last part runs" not in last.stdout
