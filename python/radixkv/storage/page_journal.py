"""What the processes that bound one file store share: a journal of the pages
written and removed, read by each into its own index, so that each knows the
whole store and the bound is the directory's, not one process's."""

from __future__ import annotations

import fcntl
import itertools
import os
import stat
import struct
import threading
from typing import List, Optional

from radixkv.storage.file_entries import remove_entry
from radixkv.storage.page_index import PageIndex

NAME = "pages.journal"
MAGIC = b"RKVJRNL1"
# A record: what happened (ADDED: the page was written, or found used later
# than the index had it; REMOVED), its key, the key of the page it extends
# (zeros: none known), the bytes of its file and its tick.
RECORD = struct.Struct("<c32s32sQQ")
ADDED, REMOVED = b"+", b"-"
NO_PARENT = bytes(32)
MAX_FILE_BYTES = 1 << 40  # a record naming more is damaged
_READ_RECORDS = 8192  # records read at a time


class PageJournal:
    """The journal of the bounded store whose directory is open as `top`
    (`attach`): file NAME there, MAGIC then records of fixed size, shared by
    every process that bounds the store, each keeping `index` (a PageIndex).

    Everything is done in `with journal:` blocks, which hold the store
    directory's lock (flock, exclusive: between processes and between the
    stores of one process; a thread lock between a store's threads; blocks
    nest). Entering reads what other processes appended since into `index`;
    `added` and `removed` change `index` and are appended on leaving. A
    journal grown past four times the pages it names is written again from
    `index` under a temporary name and renamed into place; a process that
    finds another file at NAME (renamed in, or made again) reads it from the
    start in place of what its index held.

    What is not a journal of ours at NAME (a link, a directory, a FIFO, a
    file of another format, unless `shared` another user's) is removed and
    the journal written again from `index`; a record cut short by a writer
    that died is cut off. A file system without locks gets the journal
    unlocked (records are appended whole, but processes may miss some).
    Writes and removals that bypass the journal (a store without a bound, a
    crash between a rename and its record, a file deleted by hand) are
    found by a store's start-up scan, or, for removals, when the page is
    next given up.

    `read_whole`: whether the index was read from a journal found at NAME
    (since the last `attach`), rather than started empty."""

    def __init__(self, index: PageIndex, mode: int, shared: bool) -> None:
        self.index = index
        self.read_whole = False
        self._mode = mode
        self._shared = shared
        self._uid = os.geteuid()
        self._top = -1
        self._next_top: Optional[int] = None
        self._fd = -1
        self._id: Optional[tuple] = None  # (device, inode) of the file read
        self._offset = 0  # its bytes read (or written by us) so far
        self._pending: List[bytes] = []
        self._lock = threading.RLock()
        self._depth = 0
        self._locked = False
        self._tmp_names = itertools.count()

    def attach(self, top: int) -> None:
        """The store's directory is open as `top` now (at start, or made
        again after it was deleted): from the next block on, the journal is
        the one there and what the index held is forgotten. (It waits for
        nothing: any thread may call it.)"""
        self._next_top = top

    def _switch(self) -> None:
        top, self._next_top = self._next_top, None
        if top is not None:
            self._top = top
            self._close_file()
            self.index.clear()
            self.read_whole = False

    def close(self) -> None:
        with self._lock:
            self._close_file()
            self._top, self._next_top = -1, None

    # -- the lock -------------------------------------------------------------------------

    def __enter__(self) -> "PageJournal":
        self._lock.acquire()
        self._depth += 1
        if self._depth == 1:
            self._switch()
            try:
                fcntl.flock(self._top, fcntl.LOCK_EX)
                self._locked = True
            except (OSError, ValueError):
                self._locked = False
            self._catch_up()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._depth == 1:
                self._flush()
        finally:
            self._depth -= 1
            if self._depth == 0 and self._locked:
                self._locked = False
                try:
                    fcntl.flock(self._top, fcntl.LOCK_UN)
                except (OSError, ValueError):
                    pass
            self._lock.release()

    # -- what a block does ----------------------------------------------------------------

    def added(self, key: bytes, size: int, parent: Optional[bytes], tick: int) -> None:
        """Page `key` (`size` bytes, extending `parent`) was written, or used
        at `tick`."""
        self.index.add(key, size, parent, tick)
        self._pending.append(RECORD.pack(ADDED, key, parent or NO_PARENT, size, tick))

    def removed(self, key: bytes) -> None:
        """Page `key` is no longer in the store."""
        self.index.discard(key)
        self._pending.append(RECORD.pack(REMOVED, key, NO_PARENT, 0, 0))

    # -- the file ---------------------------------------------------------------------------

    def _ours(self, st: os.stat_result) -> bool:
        return stat.S_ISREG(st.st_mode) and (self._shared or st.st_uid == self._uid)

    def _close_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._id, self._offset = -1, None, 0
        self._pending.clear()

    def _catch_up(self) -> None:
        """Reads into the index what was appended since this process last
        looked (all of it, from a file it has not read before)."""
        try:
            st = os.stat(NAME, dir_fd=self._top, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except OSError:
            return
        if st is not None and not self._ours(st):
            remove_entry(self._top, NAME)
            st = None
        if st is None:
            self._rewrite()
            return
        if (st.st_dev, st.st_ino) != self._id and not self._open():
            self._rewrite()
            return
        self._read_to_end()

    def _open(self) -> bool:
        """Opens the journal at NAME and reads it into an emptied index from
        its start; False when it is not one (the caller writes it again)."""
        self._close_file()
        flags = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(NAME, flags, dir_fd=self._top)
        except OSError:
            return False
        self._fd = fd
        try:
            st = os.fstat(fd)
            if not self._ours(st) or os.pread(fd, len(MAGIC), 0) != MAGIC:
                self._close_file()
                return False
        except OSError:
            self._close_file()
            return False
        self._id, self._offset = (st.st_dev, st.st_ino), len(MAGIC)
        self.index.clear()
        self.read_whole = True
        return True

    def _read_to_end(self) -> None:
        fd = self._fd
        try:
            end = os.fstat(fd).st_size
            whole = end - (end - len(MAGIC)) % RECORD.size
            if whole != end:  # a record cut short: its writer died (we hold the lock)
                os.ftruncate(fd, whole)
            while self._offset < whole:
                n = min(whole - self._offset, _READ_RECORDS * RECORD.size)
                chunk = os.pread(fd, n, self._offset)
                n = len(chunk) - len(chunk) % RECORD.size
                if n <= 0:
                    return
                self._apply(chunk[:n])
                self._offset += n
        except OSError:
            pass

    def _apply(self, chunk: bytes) -> None:
        index = self.index
        for kind, key, parent, size, tick in RECORD.iter_unpack(chunk):
            if kind == REMOVED:
                index.discard(key)
            elif kind == ADDED and 0 < size <= MAX_FILE_BYTES:
                index.add(key, size, None if parent == NO_PARENT else parent, tick)
            # anything else is a damaged record: skipped

    def _flush(self) -> None:
        """Appends the records of this block; a journal grown past four times
        the pages it names is written again."""
        if not self._pending:
            return
        if self._fd < 0:
            self._rewrite()
            return
        data = b"".join(self._pending)
        self._pending.clear()
        try:
            while data:
                n = os.write(self._fd, data)
                self._offset += n
                data = data[n:]
        except OSError:
            self._rewrite()
            return
        if self._offset > max(1 << 16, 4 * RECORD.size * len(self.index)):
            self._rewrite()

    def _rewrite(self) -> None:
        """Writes the journal again from the index: under a temporary name,
        renamed into place."""
        self._close_file()
        tmp = f"{NAME}.{os.getpid()}.{next(self._tmp_names)}.tmp"
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, self._mode, dir_fd=self._top)
        except OSError:
            return
        try:
            if self._shared:  # the umask must not take the group's access away
                os.fchmod(fd, self._mode)
            records = [
                RECORD.pack(ADDED, key, parent or NO_PARENT, size, tick)
                for key, tick, size, parent in self.index.entries()
            ]
            data = MAGIC + b"".join(records)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.replace(tmp, NAME, src_dir_fd=self._top, dst_dir_fd=self._top)
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=self._top)
            except OSError:
                pass
            return
        self._fd, self._id, self._offset = fd, (st.st_dev, st.st_ino), len(data)
