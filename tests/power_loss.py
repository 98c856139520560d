"""A simulated power loss for crash tests: what of a directory tree is on disk when the power goes.

A SIGKILL keeps the page cache, so it never shows a missing fsync. :class:`DurableState` follows
``os.fsync`` while installed and keeps, per inode, the bytes a file had at its last fsync and, per
directory, the entries it had at its last fsync (everything there at the start counts as synced).
:meth:`DurableState.restore` then puts the tree back as a disk that lost every unsynced write would
hold it: files cut back to their last synced bytes (empty if never synced), renames, new files and
removals undone unless their directory was synced after them.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

Tree = dict  # name -> bytes (a file) or Tree (a directory)


class PowerLoss(BaseException):
    """The power went (a BaseException, so no ``except Exception`` of the code under test goes on)."""


class DurableState:
    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.data: dict[int, bytes] = {}  # file inode -> bytes at its last fsync
        self.entries: dict[int, dict[str, int]] = {}  # directory inode -> {name: inode} at its last fsync
        self.is_dir: dict[int, bool] = {}
        self._held: dict[int, int] = {}  # inode -> an open descriptor, so the number is never reused
        self._real_fsync = os.fsync
        self.root_ino = self._baseline(self.root)

    # -- following the writes

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(os, "fsync", self.fsync)

    def fsync(self, fd: int) -> None:
        """What the simulated disk makes durable (the real fsync is not needed: the simulation
        decides what survives)."""
        link = os.readlink(f"/proc/self/fd/{fd}")
        if link != str(self.root) and not link.startswith(f"{self.root}/"):
            return self._real_fsync(fd)
        st = os.fstat(fd)
        self._hold(st.st_ino, f"/proc/self/fd/{fd}", stat.S_ISDIR(st.st_mode))
        if stat.S_ISDIR(st.st_mode):
            self.entries[st.st_ino] = self._list(fd)
        else:
            with open(f"/proc/self/fd/{fd}", "rb") as fh:  # the descriptor may be write-only
                self.data[st.st_ino] = fh.read()

    def _hold(self, ino: int, path: str, is_dir: bool, dir_fd: int | None = None) -> None:
        """Keep ``ino`` open (a new open file description: a lock held on the file stays the
        holder's). /proc/self/fd links are followed; names in a directory are never links."""
        self.is_dir[ino] = is_dir
        if ino not in self._held:
            self._held[ino] = os.open(path, os.O_RDONLY, dir_fd=dir_fd)

    def _list(self, fd: int) -> dict[str, int]:
        out = {}
        for name in os.listdir(fd):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            self._hold(st.st_ino, name, stat.S_ISDIR(st.st_mode), dir_fd=fd)
            out[name] = st.st_ino
        return out

    def _baseline(self, path: Path) -> int:
        """Everything under ``path`` as it is now counts as synced."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            ino = os.fstat(fd).st_ino
            self._hold(ino, str(path), True)
            self.entries[ino] = self._list(fd)
        finally:
            os.close(fd)
        for name, child in self.entries[ino].items():
            if self.is_dir[child]:
                self._baseline(path / name)
            else:
                self.data[child] = (path / name).read_bytes()
        return ino

    # -- the power cut

    def survivors(self) -> Tree:
        """The tree a power cut now would leave."""

        def build(ino: int) -> Tree:
            return {
                name: build(child) if self.is_dir[child] else self.data.get(child, b"")
                for name, child in self.entries.get(ino, {}).items()
            }

        return build(self.root_ino)

    def restore(self, tree: Tree) -> None:
        """Put ``tree`` in place of everything under the root (and stop following inodes)."""
        self.close()
        for child in self.root.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        _write(self.root, tree)

    def close(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()


def _write(folder: Path, tree: Tree) -> None:
    for name, node in tree.items():
        if isinstance(node, dict):
            (folder / name).mkdir()
            _write(folder / name, node)
        else:
            (folder / name).write_bytes(node)
