"""Removing whatever sits at a name in a file store's directories: a file, a
link, a FIFO, or a directory however deep, without recursion and without
leaving the tree it removes."""

from __future__ import annotations

import os
import stat

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

ENTRIES_PER_REMOVAL = 1 << 20
"""The most entries one removal takes out: past it, whoever keeps filling
the tree wins, and the entry counts as one that cannot be removed."""


def remove_entry(dir_fd: int, name: str) -> bool:
    """Removes entry `name` of the directory open as `dir_fd`, whatever it
    is, a directory with all it holds included; whether it is gone (it may
    have been gone already). Never follows a link, never recurses (a tree
    of any depth costs a few descriptors), and never acts outside the tree:
    going back up, each directory must be the one it came down from.
    Anything that cannot be removed (another user's directory, a mount
    point) leaves the entry in place and answers False."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
        else:
            _remove_tree(dir_fd, name, (st.st_dev, st.st_ino))
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _identity(fd: int):
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _remove_tree(dir_fd: int, name: str, identity) -> None:
    """Removes directory `name` of `dir_fd` (`identity`: its device and inode
    as found) and everything in it, a level at a time: down into the first
    subdirectory left, or, once a directory holds none, its other entries
    removed, up through `..` to remove it. Raises OSError when it cannot."""
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    # The names taken down, and the identities of the directories on the way
    # (the caller's first): `..` must lead back to the one above.
    names, path = [name], [_identity(dir_fd), identity]
    left = ENTRIES_PER_REMOVAL
    try:
        if _identity(fd) != identity:
            raise OSError("the directory was replaced while it was being removed")
        while True:
            down = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    left -= 1
                    if left < 0:
                        raise OSError("too many entries to remove")
                    if entry.is_dir(follow_symlinks=False):
                        down = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
            if down is not None:
                inner = os.open(down, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = inner
                names.append(down)
                path.append(_identity(fd))
                continue
            up = os.open("..", DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = up
            path.pop()
            if _identity(fd) != path[-1]:
                raise OSError("a directory was moved while it was being removed")
            os.rmdir(names.pop(), dir_fd=fd)
            if not names:
                return
    finally:
        os.close(fd)
