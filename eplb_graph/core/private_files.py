"""Files written where no other user can swap them: the placement file and the metrics snapshots.

A directory is trusted when no other user can replace an entry in it: owned by us (or root) and
not writable by group or others, or sticky (``/tmp``: an entry can be renamed or removed by its
owner only). A symbolic link is followed only if we (or root) own it. A file is replaced through
a temporary file of its own directory, opened ``O_CREAT | O_EXCL | O_NOFOLLOW`` (never an existing
name, never through a link), then ``os.replace``: the rename replaces a link at the target, never
what it points to. Only the named directory is checked, not its ancestors.
"""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

MAX_LINKS = 8  # symbolic links followed to a target before it is refused (the kernel's own limit is 40)


class UnsafePathError(ValueError):
    """A directory another user can write, or a symbolic link another user owns."""


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def directory_problem(directory: str | os.PathLike) -> str | None:
    """Why another user could replace an entry of ``directory`` (None: nobody can)."""
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory"
    if not _trusted_owner(info.st_uid):
        return f"directory {directory} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()}) or root"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        return (f"directory {directory} can be written by other users (mode {stat.filemode(info.st_mode)}, "
                f"not sticky): chmod go-w it, or choose a directory only this user can write")
    return None


def check_directory(directory: str | os.PathLike) -> None:
    """UnsafePathError naming ``directory`` where another user could replace an entry in it."""
    problem = directory_problem(directory)
    if problem:
        raise UnsafePathError(problem)


def check_link(path: str | os.PathLike) -> os.stat_result | None:
    """UnsafePathError where ``path`` is a symbolic link another user owns; its lstat (None: no entry)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode) and not _trusted_owner(info.st_uid):
        raise UnsafePathError(f"{path} is a symbolic link owned by uid {info.st_uid}, not by this user "
                              f"(uid {os.geteuid()}) or root: not followed")
    return info


def resolve_target(path: str | os.PathLike, *, for_write: bool = True) -> Path:
    """The file ``path`` names: ``path``, or where the links we own at it lead (UnsafePathError
    naming what is refused); ``for_write``: each directory on the way checked too. No ``realpath``:
    only links at the target are followed, one at a time, each checked before it is read."""
    target = Path(path)
    for _ in range(MAX_LINKS + 1):
        if for_write:
            check_directory(target.parent)
        info = check_link(target)
        if info is None or not stat.S_ISLNK(info.st_mode):
            return target
        target = target.parent / os.readlink(target)  # an absolute link replaces the parent
    raise UnsafePathError(f"{path}: more than {MAX_LINKS} symbolic links to follow")


def _default_mode() -> int:
    """What ``open(path, "w")`` would create: 0o666 less the umask (read from /proc: setting the
    umask to read it would change it for every thread for that moment)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


def replace_file(target: Path, data: bytes, *, sync: bool, mode: int | None = None) -> None:
    """Writes ``data`` to ``target`` atomically: a fresh temporary file beside it (mode 0o600 while
    written, then ``mode``, else what ``open(..., "w")`` would give), ``fsync`` where ``sync``, then
    ``os.replace``. A failure leaves ``target`` as it was and no temporary file of ours."""
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view):]
            os.fchmod(descriptor, _default_mode() if mode is None else mode)
            if sync:
                os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)  # ours: O_EXCL made it
        raise


def remove_stale_temporaries(target: Path) -> None:
    """A crashed writer's temporary files of ``target`` that we own (another user's are left alone)."""
    for stale in target.parent.glob(f".{target.name}.*.tmp"):
        try:
            if os.lstat(stale).st_uid == os.geteuid():
                stale.unlink()
        except FileNotFoundError:
            pass
