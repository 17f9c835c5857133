"""Small real filesystems for the write-failure tests: a size-limited tmpfs and a loop-mounted ext4 image.

Not test doubles: the kernel's own tmpfs and ext4 return ENOSPC when they are full and EPERM for a
file marked immutable (``chattr +i``, which tmpfs does not support, hence ext4), to the modules'
real writes. Mounting needs root; each fixture in ``conftest.py`` skips with the reason when it
cannot mount, and always unmounts.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

FILLER = "filler"


class CannotMount(Exception):
    """This machine cannot make the filesystem; the message says why (it becomes the skip reason)."""


def _run(argv: list[str], what: str) -> None:
    tool = shutil.which(argv[0])
    if tool is None:
        raise CannotMount(f"{what} needs {argv[0]}, which is not installed (apt-get install e2fsprogs mount)")
    proc = subprocess.run([tool, *argv[1:]], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CannotMount(f"{what} failed: {' '.join(argv)}: {(proc.stderr or proc.stdout).strip()}")


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise CannotMount(f"{what} needs root to mount a filesystem (running as uid {os.geteuid()})")


def _unmount(where: Path) -> None:
    # A lazy unmount as the last resort, so a busy mount never outlives the test session.
    if os.path.ismount(where):
        proc = subprocess.run(["umount", str(where)], capture_output=True, check=False)
        if proc.returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


@contextlib.contextmanager
def tmpfs(where: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (created), unmounted on the way out."""
    _need_root("a size-limited tmpfs")
    where.mkdir(parents=True, exist_ok=True)
    _run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)], "mounting a tmpfs")
    try:
        yield where
    finally:
        _unmount(where)


@contextlib.contextmanager
def ext4(where: Path, image: Path, size: str = "8M") -> Iterator[Path]:
    """An ext4 image of ``size`` (no blocks reserved for root) loop-mounted at ``where``, unmounted on the way out.

    Files left immutable in it are made mutable again before the unmount, so the image can be removed.
    """
    _need_root("a loop-mounted ext4 image")
    where.mkdir(parents=True, exist_ok=True)
    _run(["truncate", "-s", size, str(image)], "making the ext4 image file")
    _run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], "formatting the ext4 image")
    _run(["mount", "-o", "loop", str(image), str(where)], "loop-mounting the ext4 image (is /dev/loop-control there?)")
    try:
        yield where
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["chattr", "-R", "-i", "-a", str(where)], capture_output=True, check=False)
        _unmount(where)
        image.unlink(missing_ok=True)


def fill(where: Path) -> Path:
    """Fill the filesystem of ``where`` until the kernel answers ENOSPC; returns the filler file.

    Writes big chunks, then single bytes; after an fsync (ext4 gives back blocks it had reserved for
    delayed allocation) it goes on until even one byte no longer fits.
    """
    filler = where / FILLER
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for _ in range(10):
            wrote = False
            for chunk in (1 << 20, 1 << 16, 1 << 12, 1):
                data = b"\0" * chunk
                while True:
                    try:
                        os.write(fd, data)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
                    wrote = True
            os.fsync(fd)
            if not wrote:
                return filler
    finally:
        os.close(fd)
    raise AssertionError(f"{where} never filled up")


def free_bytes(where: Path) -> int:
    vfs = os.statvfs(where)
    return vfs.f_bavail * vfs.f_frsize


@contextlib.contextmanager
def immutable(*paths: Path) -> Iterator[None]:
    """``chattr +i`` on each path for the block, ``chattr -i`` after it whatever happens."""
    for path in paths:
        _run(["chattr", "+i", str(path)], f"making {path} immutable")
    try:
        yield
    finally:
        for path in paths:
            subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)


def lsattr_immutable(path: Path) -> bool:
    """Whether ``lsattr`` reports the immutable flag on ``path`` (read with the real tool)."""
    out = subprocess.run(["lsattr", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return "i" in out.split()[0]
