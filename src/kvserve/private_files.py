"""Private folders and files: the cache folder, the tenant secret, the native kernels, the disk tier.

What lives in them is either secret (the tenant secret, KV computed from tenants' prompts) or code that
the server loads (the kernels' .so files, through ctypes). So every such folder is owned by the server's
user and closed to everyone else (0700), every file in them is 0600, and no symlink is followed: another
local user must be able neither to read them nor to put something in their place.

Only the last component of a folder's path is checked: the folders above it (a home folder, a mounted
volume) are the operator's choice. A folder of ours that others may read but not write (one made by an
older version, under a 022 umask) is tightened to 0700 with a warning; one that others may write, or that
another user owns, or a symlink, is refused: what is in it cannot be trusted.
"""

import errno
import logging
import os
import stat
import tempfile

from kvserve.errors import KVServeError

log = logging.getLogger("kvserve")

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_OTHERS_ANY = stat.S_IRWXG | stat.S_IRWXO


class PrivatePathError(KVServeError, OSError):
    """A folder or file that should be private is not; the message says why and how to fix it."""


def private_dir(base: str, *parts: str) -> str:
    """`base/parts...`, each folder created 0700 if missing and checked: a real folder (not a symlink),
    owned by this user, writable by no one else. Returns the full path."""
    paths = [base]
    for part in parts:
        paths.append(os.path.join(paths[-1], part))
    for path in paths:
        if not os.path.lexists(path):
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
            except OSError as e:
                raise PrivatePathError(f"cannot create the folder {path}: {e.strerror}") from e
        _check_dir(path)
    return paths[-1]


def _check_dir(path: str) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise PrivatePathError(f"{path} is a symlink; give the real folder ({os.path.realpath(path)})")
    if not stat.S_ISDIR(st.st_mode):
        raise PrivatePathError(f"{path} is not a folder")
    if st.st_uid != os.getuid():
        raise PrivatePathError(f"{path} belongs to user id {st.st_uid}, not to this server's ({os.getuid()})")
    if st.st_mode & _OTHERS_WRITE:
        raise PrivatePathError(
            f"{path} is writable by other users, so its files cannot be trusted; check them, then run: "
            f"chmod 700 {path}"
        )
    if st.st_mode & _OTHERS_ANY:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        log.warning("%s was readable by other users; it is now 0700", path)


def open_private_file(path: str) -> int:
    """A read-only descriptor of `path`, checked to be a regular file (not a symlink, FIFO, device or
    folder), owned by this user and readable by no one else. The caller closes it.

    O_NONBLOCK keeps a FIFO put in the file's place from blocking the open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PrivatePathError(f"{path} is a symlink; put the file itself there") from e
        raise
    try:
        _check_private_fd(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_private_fd(fd: int, path: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise PrivatePathError(f"{path} is not a regular file")
    if st.st_uid != os.getuid():
        raise PrivatePathError(f"{path} belongs to user id {st.st_uid}, not to this server's ({os.getuid()})")
    if st.st_mode & _OTHERS_ANY:
        raise PrivatePathError(f"{path} is open to other users; check it, then run: chmod 600 {path}")
    return st


def is_private_file(path: str) -> bool:
    """Whether `path` passes open_private_file's checks (False when it is missing)."""
    try:
        os.close(open_private_file(path))
    except OSError:
        return False
    return True


def read_private_file(path: str, max_bytes: int) -> bytes:
    """The content of a private file of at most `max_bytes` (checked before reading)."""
    fd = open_private_file(path)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise PrivatePathError(f"{path} is {size} bytes, more than the {max_bytes} expected")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(max_bytes + 1)
    finally:
        os.close(fd)


def create_private_file(path: str, data: bytes) -> bool:
    """Create `path` (0600) holding `data`, atomically: the data is written and synced under a temporary
    name, then linked to `path`, so that a crash never leaves a partial file and two processes starting
    at once agree on one file. False when `path` already exists (it is left as it is)."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path, follow_symlinks=False)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


def private_cached_file(cache_dir: str, folder: str, name: str) -> tuple[str, bool]:
    """The path of `name` in the private folder `cache_dir/folder` (both checked, made if missing), and
    whether a private regular file is there already. When not, the caller builds it (private, 0600)
    and renames it into place: a file that fails the checks is replaced, never used."""
    path = os.path.join(private_dir(cache_dir, folder), name)
    return path, is_private_file(path)
