"""Small real filesystems for the write-failure tests: a size-limited tmpfs, a loop-mounted ext4 image
(writable, or remounted read-only) and an ext4 image served through FUSE by fuse2fs.

Not test doubles: the kernel's own tmpfs and ext4 return ENOSPC when they are full, EPERM for a
file marked immutable (``chattr +i``, which tmpfs does not support, hence ext4) and EROFS once
remounted read-only, to the modules' real writes. The kernel's FUSE layer answers EINVAL to
``renameat2(RENAME_EXCHANGE)`` when the server (fuse2fs, built on libfuse 2) has no rename2,
as NFS and vfat do; vfat itself is not in this kernel. Mounting needs root; each fixture in
``conftest.py`` skips with the reason when it cannot mount, and always unmounts.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

FILLER = "filler"


class CannotMount(Exception):
    """This machine cannot make the filesystem; the message says why (it becomes the skip reason)."""


def _tool(name: str, what: str, package: str = "e2fsprogs mount") -> str:
    tool = shutil.which(name)
    if tool is None:
        raise CannotMount(f"{what} needs {name}, which is not installed (apt-get install {package})")
    return tool


def _run(argv: list[str], what: str) -> None:
    tool = _tool(argv[0], what)
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


@contextlib.contextmanager
def read_only(where: Path) -> Iterator[Path]:
    """``mount -o remount,ro`` the filesystem mounted at ``where`` for the block, read-write again after it."""
    _run(["mount", "-o", "remount,ro", str(where)], f"remounting {where} read-only")
    try:
        yield where
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(where)], capture_output=True, check=False)


@contextlib.contextmanager
def fuse_ext4(where: Path, image: Path, size: str = "8M") -> Iterator[Path]:
    """An ext4 image of ``size`` served by fuse2fs (in the foreground, a child of this process) at ``where``.

    The kernel's FUSE side answers EINVAL to RENAME_EXCHANGE there. Unmounted on the way out; the
    fuse2fs process then exits (it is killed, by its pid, if it has not within 5 s).
    """
    _need_root("a FUSE mount of an ext4 image")
    fuse2fs = _tool("fuse2fs", "a FUSE mount of an ext4 image", "fuse2fs")
    if not os.path.exists("/dev/fuse"):
        raise CannotMount("a FUSE mount needs /dev/fuse, which this machine does not have")
    where.mkdir(parents=True, exist_ok=True)
    _run(["truncate", "-s", size, str(image)], "making the ext4 image file")
    _run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], "formatting the ext4 image")
    proc = subprocess.Popen([fuse2fs, "-f", str(image), str(where)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(where):
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode(errors="replace").strip() if proc.poll() is not None else ""
                raise CannotMount(f"fuse2fs did not mount {image} at {where}: {out or 'timed out'}")
            time.sleep(0.02)
        yield where
    finally:
        _unmount(where)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
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
