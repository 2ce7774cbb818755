"""The embedded storage backend: one file per page under a directory."""

from __future__ import annotations

import errno
import hmac
import itertools
import os
import stat
import struct
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

from radixkv._checks import as_count
from radixkv._core import crc32c
from radixkv.storage.base import TAG_BYTES, StorageBackend
from radixkv.kvcache.page_codec import codec_seed
from radixkv.storage.file_entries import DIR_FLAGS, remove_entry
from radixkv.storage.page_index import PageIndex
from radixkv.storage.page_journal import NAME as JOURNAL_NAME
from radixkv.storage.page_journal import PageJournal

MAGIC = b"RKVPAGE4"
# magic, key (32 raw bytes), the key of the page it extends (32; zeros: none
# known), configuration fingerprint (32), payload length, CRC-32C
HEADER = struct.Struct("<8s32s32s32sQI")
# A page of a store with a secret: magic, key, parent key, fingerprint,
# length, and the page's authentication tag (HMAC-SHA-256 over its key and
# bytes).
MAGIC_KEYED = b"RKVPAGE5"
HEADER_KEYED = struct.Struct(f"<8s32s32s32sQ{TAG_BYTES}s")
# Pages of earlier versions (without the parent key): a start-up scan
# removes them as pages of another format, not as damaged ones.
OLD_MAGICS = (b"RKVPAGE2", b"RKVPAGE3")
NO_PARENT = bytes(32)

# Errors that say the entry at a page's path is not a page of ours (a link,
# a directory, a device, unreadable, damaged): a miss for that page, and the
# entry is removed. Any other error (out of descriptors or memory, a store
# closed) says nothing of the entry: an error, and the entry stays.
_BAD_ENTRY = frozenset(
    {
        errno.ELOOP,
        errno.EACCES,
        errno.EPERM,
        errno.EISDIR,
        errno.ENXIO,
        errno.ENODEV,
        errno.EIO,
        errno.EOVERFLOW,
        errno.ETXTBSY,
        errno.EINVAL,
    }
)

# File systems whose calls may hang on another machine: existence queries on
# them are asked with a bound (StorageBackend.blocking_queries).
NETWORK_FILE_SYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "beegfs",
        "9p",
        "afs",
        "ocfs2",
        "gfs2",
        "fuse",
        "fuseblk",
    }
)


def file_system_type(path: str) -> str:
    """The type of the file system `path` is on, from /proc/self/mountinfo
    ('' when it cannot be told)."""
    path = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    best, kind = -1, ""
    for line in lines:
        parts = line.split()
        if "-" not in parts or len(parts) < 5:
            continue
        point = parts[4].encode().decode("unicode_escape")  # octal escapes (\040)
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), parts[parts.index("-") + 1]
    return kind


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that writes temporary file `tmp_name`
    (`<key>.page.<pid>.<n>.tmp`) still runs."""
    try:
        pid = int(tmp_name.split(".")[-3])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # another user's process
    return True


class _InTheWay(Exception):
    """An entry in a page's way (at its path, or in place of its key
    directory) that can neither be removed nor written in: another user's
    directory. The page's write fails, a bad entry counted in
    `corrupt_pages`, not an error of the store."""


class FileStorage(StorageBackend):
    """Pages as files `directory/<fingerprint[:16]>/<key[:2]>/<key>.page`,
    each a header (magic, the page key, the configuration fingerprint, the
    payload length and its CRC-32C, or with a secret its authentication tag)
    and the page's bytes. A write goes to a temporary name and is renamed
    into place, so a reader sees a whole page or none. A read checks every
    header field and the checksum (the tag) before the page counts.

    Whatever sits at a page's path that is not a page of ours is a miss for
    that page alone, counted in `corrupt_pages` and removed (the next write
    puts the page there): a corrupt, truncated or foreign file, a directory
    however deep, a FIFO or device, a symlink, a file the process may not
    read or (unless `shared`) one another user owns. Reads never block on
    such an entry. One that cannot be removed (another user's directory)
    costs that page alone: counted, never an error that backs the store off.

    Pages are reached from the store's own directory, held open, a key
    directory at a time, never through a link: nothing outside the store's
    directories is read, written or removed, whatever is done to the paths
    above it or to its key directories. What is in the place of one of its
    directories that is not a directory (the configuration's, whose name
    anyone can compute from the public model configuration, or a key
    directory: a file, a FIFO, a link) is removed like a bad page and the
    directory made; so is a key directory of another user the process may
    not write in, when it can be removed (else its pages are misses).

    Trust. By default the store is this user's: the directories are created
    0700 (the missing ones above it too) and the pages 0600, and a store
    directory that another user owns or that others may write to is refused
    (PermissionError). `shared=True` says the store is shared on purpose
    (with the group, whatever the umask: directories 0770, pages 0640; pages
    of other users are read; a setgid store directory keeps the group, and
    the setgid bit, on every directory made in it). Anyone who can write to
    a store can plant pages in it; with a `secret` (see StorageBackend) they
    cannot: a page that fails its tag is a miss, counted and removed.

    `max_bytes` bounds the bytes of the store's page files (their sizes: the
    disk blocks they take, and the directories, come on top): past it, pages
    are removed least recently used (written or read) first, but never a
    page before the pages that extend it (a page's header names the page it
    extends; a suffix is read only after its prefix). See PageIndex. The
    bound is the directory's, whichever processes write to it: every store
    with a bound on the directory appends the pages it writes and removes to
    a journal there (PageJournal) and reads the others' into its index, so
    each knows every page and the first to exceed the bound gives up the
    least recently used page of any; a page another process read since is
    kept in its place in the order (its file's time says so). At start a
    thread scans the directory and checks every page's header (its magic,
    its key against its name, the fingerprint, its length against its
    size); what fails is removed, pages the journal does not name are added
    to it (written by a store without a bound, or before the journal), and
    pages it names that are gone leave it. The store serves at once: a read
    checks every page whole anyway. The bound holds at once when a journal
    was there, else from the end of the scan (`wait_indexed`), which
    removes what exceeds it. A page removed under a reader is a miss.

    `bounded_queries` (None: when the directory is on a network file system)
    makes the storage tier ask existence queries from the scheduler's thread
    with a bound, as a stat() there may hang.
    """

    def __init__(
        self,
        directory: str,
        fingerprint: bytes,
        max_bytes: Optional[int] = None,
        *,
        shared: bool = False,
        secret: Optional[bytes] = None,
        bounded_queries: Optional[bool] = None,
        codec: Optional[str] = None,
    ):
        super().__init__(secret, codec)
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
        directory = os.fspath(directory)
        if not directory:
            raise ValueError("directory must name a directory, got ''")
        if not isinstance(fingerprint, bytes) or len(fingerprint) != 32:
            raise ValueError("fingerprint must be 32 bytes (radixkv.storage.config_fingerprint)")
        if max_bytes is not None:
            max_bytes = as_count(max_bytes, "max_bytes")
        # Encoded pages are another configuration's: a directory and keys
        # of their own.
        fingerprint = codec_seed(fingerprint, self.codec)
        self.shared = bool(shared)
        self._uid = os.geteuid()
        self._dir_mode, self._page_mode = (0o770, 0o640) if self.shared else (0o700, 0o600)
        root = os.path.abspath(directory)
        self._prepare_dir(root, parents=True)
        # Each configuration's pages in a directory of their own: one never
        # takes another's file for its page, and never skips a write for it.
        self.directory = os.path.join(root, fingerprint.hex()[:16])
        self._prepare_dir(self.directory, replace=True)
        self.fingerprint = fingerprint
        self._header = HEADER_KEYED if self.keyed else HEADER
        self._top = -1
        self._top_closers: list = []
        self._open_top()
        self._tmp_names = itertools.count()
        self.max_bytes = max_bytes
        # A bounded store's index is the directory's (its journal's): the
        # store gives pages up itself, for the directory's bound.
        self._index = None if max_bytes is None else PageIndex(None)
        self._journal = None
        if self._index is not None:
            self._journal = PageJournal(self._index, 0o660 if self.shared else 0o600, self.shared)
            self._journal.attach(self._top)
        self.removed_pages = 0  # pages removed to keep the bound (or of an old format)
        self.index_seconds: Optional[float] = None  # how long the start-up scan took
        self._indexed = threading.Event()
        if bounded_queries is None:
            bounded_queries = file_system_type(root).split(".")[0] in NETWORK_FILE_SYSTEMS
        self.blocking_queries = bool(bounded_queries)
        self.concurrent_calls = True  # a file per page, written aside and renamed
        if self._journal is None:
            self._indexed.set()
        else:
            threading.Thread(
                target=self._scan, args=(self._journal,), name="radixkv-file-scan", daemon=True
            ).start()

    # -- the directories --------------------------------------------------------------

    def _prepare_dir(self, path: str, parents: bool = False, replace: bool = False) -> None:
        """Makes `path` a directory of the store (with the store's mode, and
        so the directories missing above it with `parents`) or checks the
        one there: a directory, and unless shared, this user's and not
        writable by others. With `replace`, what is in its place that is not
        a directory is removed (a bad entry) and the directory made."""
        if parents:
            self._make_parents(path)
        for again in (False, True):
            try:
                self._mkdir(path)
            except FileExistsError:
                pass
            except NotADirectoryError:
                raise NotADirectoryError(
                    errno.ENOTDIR, f"directory {path!r}: a part of it is not a directory"
                ) from None
            except OSError as e:
                raise OSError(e.errno, f"directory {path!r}: {e.strerror}") from None
            st = os.stat(path) if parents else os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                break
            if not replace or again:
                raise NotADirectoryError(errno.ENOTDIR, f"directory {path!r} is not a directory")
            self.count_corrupt()
            try:
                os.unlink(path)  # a file, a FIFO, a link (never followed)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise OSError(e.errno, f"directory {path!r}: {e.strerror}") from None
        if self.shared:
            return
        if st.st_uid != self._uid:
            raise PermissionError(
                errno.EPERM,
                f"directory {path!r} belongs to uid {st.st_uid}, "
                f"not to this process (uid {self._uid}): pass shared=True "
                "if the store is shared on purpose",
            )
        if st.st_mode & 0o022:
            raise PermissionError(
                errno.EPERM,
                f"directory {path!r} is writable by others (mode "
                f"{stat.S_IMODE(st.st_mode):o}): pass shared=True if the "
                "store is shared on purpose",
            )

    def _make_parents(self, path: str) -> None:
        """Makes the directories missing above `path`, each with the store's
        mode (whatever the umask)."""
        missing = []
        parent = os.path.dirname(path)
        while parent and not os.path.lexists(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(missing):
            try:
                self._mkdir(d)
            except FileExistsError:
                pass  # made meanwhile
            except NotADirectoryError:
                raise NotADirectoryError(
                    errno.ENOTDIR, f"directory {path!r}: a part of it is not a directory"
                ) from None
            except OSError as e:
                raise OSError(e.errno, f"directory {path!r}: {e.strerror}") from None

    def _mkdir(self, path: str) -> None:
        """Makes directory `path` with the store's mode."""
        os.mkdir(path, self._dir_mode)
        if self.shared:  # the umask must not take the group's access away
            os.chmod(path, self._dir_mode | (os.stat(path).st_mode & stat.S_ISGID))

    def _scan(self, journal: PageJournal) -> None:
        """Reads the journal (when there is one, it names every page: the
        bound holds from then on), then indexes the pages already there
        (their headers checked), removes what is not a page of ours and the
        temporary files of writers that died before they renamed theirs;
        then the bound holds in any case."""
        started = time.monotonic()
        since = journal.index.tick()
        with journal:
            if journal.read_whole:
                journal.index.complete()
                self._trim(journal)
        found: Dict[bytes, Tuple[int, int, Optional[bytes]]] = {}
        whole = True
        top = self._top
        try:
            with os.scandir(top) as subs:
                for sub in subs:
                    if self._top < 0:  # closed
                        return
                    if sub.is_dir(follow_symlinks=False):
                        whole = self._scan_dir(top, sub.name, found) and whole
                    elif sub.name.startswith(JOURNAL_NAME) and sub.name.endswith(".tmp"):
                        self._drop_tmp(top, sub.name)
        except OSError:
            self.count_error()
            whole = False
        finally:
            if self._top >= 0:
                with journal:
                    self._take_scan(journal, found, since, whole)
            self.index_seconds = time.monotonic() - started
            self._indexed.set()

    def _scan_dir(self, top: int, sub: str, found: dict) -> bool:
        """Scans directory `sub` of the store's; whether it could be read."""
        try:
            fd = os.open(sub, DIR_FLAGS, dir_fd=top)
        except OSError:
            return False
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    self._scan_entry(fd, sub, entry, found)
        except OSError:
            return False
        finally:
            os.close(fd)
        return True

    def _scan_entry(self, dir_fd: int, sub: str, entry: os.DirEntry, found: dict) -> None:
        """One entry of key directory `sub` (open as `dir_fd`): a page of ours
        goes into `found` (key: modification time, size, parent)."""
        name = entry.name
        if name.endswith(".tmp"):
            self._drop_tmp(dir_fd, name)
            return
        key = name[:-5] if name.endswith(".page") else ""
        try:
            raw_key = bytes.fromhex(key)
        except ValueError:
            raw_key = b""
        if len(raw_key) != 32:
            return  # not a page's name: another program's file, left alone
        if key != raw_key.hex() or sub != key[:2]:
            # Named like a page but not where (or as) the store puts one:
            # never read, so never counted; removed.
            self._drop_entry(dir_fd, name)
            return
        header = self._header
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:  # removed by another process meanwhile
            return
        except OSError as e:
            if e.errno in _BAD_ENTRY:
                self._drop_entry(dir_fd, name)
            else:
                self.count_error()
            return
        st, head = None, b""
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                head = os.read(fd, header.size)
        except OSError:
            pass
        finally:
            os.close(fd)
        if st is None:
            self.count_error()
            return
        if head[:8] in OLD_MAGICS and (self.shared or st.st_uid == self._uid):
            try:  # a page of an earlier version
                os.unlink(name, dir_fd=dir_fd)
                self.removed_pages += 1
            except OSError:
                pass
            return
        if head[:8] == (MAGIC if self.keyed else MAGIC_KEYED):
            return  # a page of a store with another secret (or none): not ours to count
        fields = header.unpack(head) if len(head) == header.size else None
        if fields is None or not self._ours(st):
            self._drop_entry(dir_fd, name)
            return
        magic, in_key, parent, fingerprint, length, _ = fields
        if (
            magic != (MAGIC_KEYED if self.keyed else MAGIC)
            or in_key != raw_key
            or fingerprint != self.fingerprint
            or st.st_size != header.size + length
            or (self.page_bytes and length != self.page_bytes)
        ):
            self._drop_entry(dir_fd, name)
            return
        found[raw_key] = (st.st_mtime_ns, st.st_size, None if parent == NO_PARENT else parent)

    def _take_scan(self, journal: PageJournal, found: dict, since: int, whole: bool) -> None:
        """(In a journal block.) What the scan found becomes the index's:
        pages the journal did not name join it, pages it named from before
        the scan began that the scan did not find (when it read every
        directory) leave it, and a page whose file was used later than the
        index has it takes its place in the order; then the index is
        complete and the bound holds."""
        index = journal.index
        for raw, (mtime, size, parent) in found.items():
            tick = index.tick_of(raw)
            if tick is None:
                journal.added(raw, size, parent, mtime)
            elif mtime > tick:
                index.touch(raw, mtime)
        if whole:
            for raw, tick, _, _ in index.entries():
                if tick < since and raw not in found:
                    journal.removed(raw)
        index.complete()
        self._trim(journal)

    def _drop_entry(self, dir_fd: int, name: str) -> None:
        """An entry the scan found that is not a page of ours: removed."""
        self.count_corrupt()
        remove_entry(dir_fd, name)

    @staticmethod
    def _drop_tmp(dir_fd: int, name: str) -> None:
        """A temporary file: removed if the process writing it is gone."""
        if not _writer_alive(name):
            try:
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                pass

    def _trim(self, journal: PageJournal) -> None:
        """(In a block of `journal`.) Gives up pages, the least recently used
        page no stored page extends first, until the store's page files fit
        the bound. A page whose file was used later than the index has it
        (read by another process) takes its place in the order instead."""
        index, bound = journal.index, self.max_bytes or 0
        while index.total > bound:
            leaf = index.pop_leaf()
            if leaf is None:
                return
            raw, tick, size, parent = leaf
            try:
                at = self._where(raw.hex(), create=False)
            except OSError:
                index.add(raw, size, parent, tick)  # kept: nothing said it is gone
                self.count_error()
                return
            if at is None:
                journal.removed(raw)
                continue
            dir_fd, name = at
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_mtime_ns > tick:
                    journal.added(raw, size, parent, st.st_mtime_ns)
                    continue
                if stat.S_ISREG(st.st_mode):
                    os.unlink(name, dir_fd=dir_fd)
                    self.removed_pages += 1
                # (anything else there is no page: a read or write removes it)
                journal.removed(raw)
            except FileNotFoundError:
                journal.removed(raw)
            except OSError:
                index.add(raw, size, parent, tick)
                self.count_error()
                return
            finally:
                os.close(dir_fd)

    def wait_indexed(self, timeout: Optional[float] = None) -> bool:
        """Waits for the start-up scan: whether it is done (the bound holds)."""
        return self._indexed.wait(timeout)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the page files in the index (the directory's, as far as
        this process knows; 0 without `max_bytes`)."""
        return 0 if self._index is None else self._index.total

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key[:2], key + ".page")

    @property
    def file_bytes(self) -> int:
        """Bytes of one page's file."""
        return self._header.size + self.page_bytes

    def _ours(self, st: os.stat_result) -> bool:
        """A page file of ours: a regular file of a page's size (once a pool
        is attached) that this user owns (any user's, when shared)."""
        return (
            stat.S_ISREG(st.st_mode)
            and (st.st_size == self.file_bytes or not self.page_bytes)
            and (self.shared or st.st_uid == self._uid)
        )

    # -- the directory a page is in ------------------------------------------------------

    def _open_top(self) -> None:
        """Holds the configuration's directory open: pages are reached from
        it without following a symlink, whatever is done to the paths above
        (a directory of the store swapped for a link leads nowhere else)."""
        fd = os.open(self.directory, DIR_FLAGS)
        # One held before stays open until close(): the other thread may be
        # inside a call through it, and a number closed now could be reused.
        self._top = fd
        self._top_closers.append(weakref.finalize(self, os.close, fd))

    def _where(self, key: str, create: bool) -> Optional[Tuple[int, str]]:
        """Where `key`'s page file is: its key directory, open (the caller
        closes it), and the file's name there; None when that directory does
        not exist (and not `create`). The key directory is opened from the
        store's own directory (held open), never through a link: what is in
        its place that is not a directory, or another user's directory this
        process may not read, is a bad entry, removed if it can be (and with
        `create` the directory made; one that cannot be removed raises
        _InTheWay)."""
        sub = key[:2]
        for again in (False, True):
            try:
                return os.open(sub, DIR_FLAGS, dir_fd=self._top), f"{key}.page"
            except FileNotFoundError:
                if not create:
                    return None
            except OSError as e:
                not_dir = e.errno in (errno.ENOTDIR, errno.ELOOP)
                if not not_dir and not (
                    e.errno in (errno.EACCES, errno.EPERM) and self._theirs(sub)
                ):
                    raise
                self.count_corrupt()
                if not remove_entry(self._top, sub):
                    if create:
                        raise _InTheWay() from None
                    return None
                if not create:
                    return None
            if again:
                break
            self._make(sub)
        raise FileNotFoundError(errno.ENOENT, f"cannot make the directory of page {key}")

    def _theirs(self, sub: str) -> bool:
        """Whether key directory `sub` is another user's (why it could not
        be opened, or a page not made in it)."""
        try:
            return os.stat(sub, dir_fd=self._top, follow_symlinks=False).st_uid != self._uid
        except OSError:
            return False

    def _make(self, sub: str) -> None:
        """Makes key directory `sub` (a non-directory in its way is removed,
        a bad entry); a store whose directory was deleted is made again
        first."""
        for again in (False, True):
            try:
                os.mkdir(sub, self._dir_mode, dir_fd=self._top)
            except FileExistsError:
                st = os.stat(sub, dir_fd=self._top, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    return  # made meanwhile
                self.count_corrupt()
                if not remove_entry(self._top, sub):
                    raise _InTheWay() from None
                os.mkdir(sub, self._dir_mode, dir_fd=self._top)
            except FileNotFoundError:
                if again:
                    raise
                self._remake()
                continue
            if self.shared:  # the umask must not take the group's access away
                fd = os.open(sub, DIR_FLAGS, dir_fd=self._top)
                try:
                    os.fchmod(fd, self._dir_mode | (os.fstat(fd).st_mode & stat.S_ISGID))
                finally:
                    os.close(fd)
            return

    def _remake(self) -> None:
        """The store's directory was deleted: it is made again (whatever
        was put in its place removed)."""
        self._prepare_dir(os.path.dirname(self.directory), parents=True)
        self._prepare_dir(self.directory, replace=True)
        self._open_top()
        if self._journal is not None:
            self._journal.attach(self._top)

    # -- reads -------------------------------------------------------------------------

    def batch_exists(self, keys: Sequence[str]) -> int:
        """(On the scheduler's thread: a stat() per page. A bad entry there
        is a miss; one that is not a directory is removed at once, a
        directory by the write that puts the page there.)"""
        if self._top < 0:  # closed
            return 0
        for i, key in enumerate(keys):
            try:
                at = self._where(key, create=False)
                if at is None and self._reopened():  # the store was made again
                    at = self._where(key, create=False)
            except OSError:
                self.count_error()
                return i
            if at is None:
                return i
            dir_fd, name = at
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if self._ours(st):
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    self.count_corrupt()
                    remove_entry(dir_fd, name)
                    self._forget(key)
                return i
            except (FileNotFoundError, NotADirectoryError):
                return i
            except OSError:
                self.count_error()
                return i
            finally:
                os.close(dir_fd)
        return len(keys)

    def batch_get(self, keys: Sequence[str], host_pages: Sequence[int]) -> List[bool]:
        return [self._get(k, p) for k, p in zip(keys, host_pages)]

    def _open(self, key: str, at: Tuple[int, str]) -> Optional[int]:
        """A descriptor of `key`'s page file (`at` from `_where`), or None: a
        miss (a bad entry there is removed). Never blocks on a FIFO or device."""
        try:
            fd = os.open(
                at[1], os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=at[0]
            )
        except (FileNotFoundError, NotADirectoryError):
            self._forget(key)
            return None
        except OSError as e:  # a symlink (ELOOP), EACCES, EIO, ...: this entry only
            if e.errno in _BAD_ENTRY:
                self._bad_entry(key, at)
            else:
                self.count_error()
            return None
        try:
            ok = self._ours(os.fstat(fd))
        except OSError:
            ok = False
        if not ok:
            os.close(fd)
            self._bad_entry(key, at)
            return None
        return fd

    def _get(self, key: str, page: int) -> bool:
        if self._top < 0:  # closed
            self.count_error()
            return False
        for again in (False, True):
            try:
                at = self._where(key, create=False)
            except OSError:
                self.count_error()
                return False
            if at is None:
                if not again and self._reopened():
                    continue
                self._forget(key)
                return False
            try:
                return self._read(key, page, at)
            finally:
                os.close(at[0])
        return False

    def _reopened(self) -> bool:
        """After a miss: if the directory held open was deleted and the
        store's path leads to one again (another process made it), that one
        is held from now on. Whether it changed."""
        try:
            if os.fstat(self._top).st_nlink:
                return False
            self._open_top()
        except OSError:
            return False
        if self._journal is not None:
            self._journal.attach(self._top)
        return True

    def _read(self, key: str, page: int, at: Tuple[int, str]) -> bool:
        fd = self._open(key, at)
        if fd is None:
            if self._reopened():  # the store was deleted, and made again
                return self._get(key, page)
            return False
        view = self.page_target(page)
        header = self._header
        try:
            with open(fd, "rb", buffering=0) as f:
                head = f.read(header.size)
                if len(head) != header.size:
                    return self._bad_entry(key, at)
                magic, raw_key, _, fingerprint, length, check = header.unpack(head)
                if (
                    magic != (MAGIC_KEYED if self.keyed else MAGIC)
                    or raw_key != bytes.fromhex(key)
                    or fingerprint != self.fingerprint
                    or length != self.page_bytes
                ):
                    return self._bad_entry(key, at)
                if f.readinto(view) != length or f.read(1):
                    return self._bad_entry(key, at)
                if self._index is not None:
                    tick = self._index.tick()
                    try:  # the time of its last use, for the order after a restart
                        os.utime(f.fileno(), ns=(tick, tick))
                    except OSError:
                        pass
        except OSError as e:  # EIO on this file
            if e.errno in _BAD_ENTRY:
                return self._bad_entry(key, at)
            self.count_error()
            return False
        if self.keyed:
            if not hmac.compare_digest(self.tag(key, view), check):
                return self._bad_entry(key, at)
        elif crc32c(view) != check:
            return self._bad_entry(key, at)
        self.page_landed(page, view)
        if self._index is not None:
            self._index.touch(bytes.fromhex(key), tick)
        return True

    def _bad_entry(self, key: str, at: Tuple[int, str]) -> bool:
        """What sits at a page's path is not a page of ours: a miss, counted
        and removed, so the next write of the page puts a good one there.
        One that cannot be removed (another user's directory) costs its page
        alone: a bad entry, not an error of the store."""
        self.count_corrupt()
        remove_entry(*at)
        self._forget(key)
        return False

    def _forget(self, key: str) -> None:
        """Page `key` is gone (removed by another process, or bad)."""
        if self._index is not None:
            self._index.discard(bytes.fromhex(key))

    # -- writes ------------------------------------------------------------------------

    def batch_set(
        self,
        keys: Sequence[str],
        host_pages: Sequence[int],
        parents: Optional[Sequence[Optional[str]]] = None,
    ) -> List[bool]:
        """(`parents[i]`: the key of the page `keys[i]` extends, None for
        none known; it goes into the page's header, for the bound's order.)"""
        if parents is None:
            parents = [None] * len(keys)
        elif len(parents) != len(keys):
            raise ValueError(f"parents has {len(parents)} keys but keys has {len(keys)}")
        return [self._set(k, p, up) for k, p, up in zip(keys, host_pages, parents)]

    def _set(self, key: str, page: int, parent: Optional[str] = None) -> bool:
        if self._top < 0:  # closed
            self.count_error()
            return False
        raw_parent = None if parent is None else bytes.fromhex(parent)
        tick = None if self._index is None else self._index.tick()
        return self._put(key, page, raw_parent, tick)

    def _put(self, key: str, page: int, parent: Optional[bytes], tick: Optional[int]) -> bool:
        """Writes page `key` (its header naming `parent`), its file's time
        `tick` when given; errors are counted. An entry in its way that stays
        (another user's) fails this page alone, counted as a bad entry."""
        view = self.page_data(page)
        raw_parent = NO_PARENT if parent is None else parent
        if self.keyed:
            header = HEADER_KEYED.pack(
                MAGIC_KEYED,
                bytes.fromhex(key),
                raw_parent,
                self.fingerprint,
                self.page_bytes,
                self.tag(key, view),
            )
        else:
            header = HEADER.pack(
                MAGIC,
                bytes.fromhex(key),
                raw_parent,
                self.fingerprint,
                self.page_bytes,
                crc32c(view),
            )
        for again in (False, True):
            try:
                self._write(key, header, view, parent, tick)
                return True
            except _InTheWay:
                return False
            except (FileNotFoundError, NotADirectoryError):
                # Its directory (or the store's) was deleted under us: made
                # again, once.
                if again:
                    break
                try:
                    if os.fstat(self._top).st_nlink == 0:
                        self._remake()
                except _InTheWay:
                    return False
                except OSError:
                    break
            except OSError:
                break
        self.count_error()
        return False

    def _write(
        self, key: str, header: bytes, view, parent: Optional[bytes], tick: Optional[int]
    ) -> None:
        """The page file of `key`: written under a temporary name (modified
        at `tick`, when given), renamed into place."""
        at = self._where(key, create=True)
        if at is None:  # (`create` makes it, or raises)
            raise FileNotFoundError(errno.ENOENT, f"no directory for page {key}")
        dir_fd, name = at
        tmp = f"{name}.{os.getpid()}.{next(self._tmp_names)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:
                fd = os.open(tmp, flags, self._page_mode, dir_fd=dir_fd)
            except PermissionError:
                self._unwritable(key[:2])
                raise
            try:
                if self.shared:
                    os.fchmod(fd, self._page_mode)
                with open(fd, "wb") as f:
                    f.write(header)
                    f.write(view)
                    if tick is not None:
                        f.flush()
                        os.utime(fd, ns=(tick, tick))
                self._place(key, tmp, dir_fd, name, parent, tick)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except OSError:
                    pass
                raise
        finally:
            os.close(dir_fd)

    def _unwritable(self, sub: str) -> None:
        """No file could be made in key directory `sub`. If it is another
        user's, it is a bad entry: removed (raising FileNotFoundError: the
        write makes it again), or raising _InTheWay when it cannot be."""
        if not self._theirs(sub):
            return
        self.count_corrupt()
        if remove_entry(self._top, sub):
            raise FileNotFoundError(errno.ENOENT, f"key directory {sub} removed")
        raise _InTheWay()

    def _place(
        self, key: str, tmp: str, dir_fd: int, name: str, parent: Optional[bytes], tick
    ) -> None:
        """Renames `tmp` into place as page `key`. A bounded store does it in
        a journal block: the page is noted, then the bound kept."""
        journal = self._journal
        if journal is None:
            self._replace(tmp, dir_fd, name)
            return
        with journal:
            self._replace(tmp, dir_fd, name)
            journal.added(bytes.fromhex(key), self.file_bytes, parent, tick)
            self._trim(journal)

    def _replace(self, tmp: str, dir_fd: int, name: str) -> None:
        try:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as e:
            # A directory (or another entry rename cannot replace) in the way
            # of the page: removed like a corrupt page, then the page goes in.
            if e.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            self.count_corrupt()
            if not remove_entry(dir_fd, name):
                raise _InTheWay() from None
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def close(self) -> None:
        """Lets go of the store's directory: later calls fail (and count)."""
        self._top = -1
        if self._journal is not None:
            self._journal.close()
        for closer in self._top_closers:
            closer()
