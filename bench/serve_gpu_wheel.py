"""Shrink Ray's wheel to what a GPU call can carry: drop ``ray/jars/`` (Java workers) and the
dashboard's ``*.js.map`` source maps, which nothing in a Python-only Serve run loads, and rewrite
the wheel's RECORD to match (pip checks it). Ray 2.60's cp312 wheel: 75.6 MiB -> ~44 MiB.

    python bench/serve_gpu_wheel.py .whl/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl   # in place
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import tempfile
import zipfile


def dropped(name: str) -> bool:
    return name.startswith("ray/jars/") or name.endswith(".js.map")


def shrink(path: str) -> tuple[int, int]:
    """Rewrite ``path`` without the dropped files; (bytes before, bytes after)."""
    before = os.path.getsize(path)
    fd, tmp = tempfile.mkstemp(suffix=".whl", dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if dropped(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and not dropped(r[0])]
                out = io.StringIO()
                csv.writer(out, lineterminator="\n").writerows(rows)
                data = out.getvalue().encode()
            dst.writestr(info, data)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would follow the wheel
    os.replace(tmp, path)
    return before, os.path.getsize(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheels", nargs="+")
    for path in ap.parse_args().wheels:
        before, after = shrink(path)
        print(f"{path}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
