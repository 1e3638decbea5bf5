"""One writer per output: an exclusive lock on a directory, held by the kernel.

    with DirLock(run_dir, "dittrain run"):
        ...  # the only writer of run_dir until the block ends or the process dies
    with rank_zero_lock(out, "ditdata caption"):
        ...  # the same, taken by rank 0 alone for every rank of a torchrun job

The lock is flock(2) on DIR/.ditkit.lock: the kernel drops it when the holder exits, is
killed (SIGKILL included) or closes it, so a dead writer never leaves a stale lock and
the next run simply takes it. A second writer does not wait: it fails at once with a
`DirectoryBusy` naming the holder's command and pid (written into the lock file by the
holder right after it took the lock).

Two details make it hold up:
- flock locks belong to the open file, which forked children share. A forked child (a
  streaming-loader worker, say) that outlived a SIGKILLed parent would keep the lock,
  so every held lock's descriptor is closed in the child right after fork (closing a
  shared descriptor does not release the parent's lock; only the last close does).
- The file is deleted only when the holder created the directory and leaves it
  otherwise empty (a refused or failed start leaves nothing behind); a writer that locked
  a file that was unlinked meanwhile notices (its inode is no longer the path's) and
  retries, so two writers can never both believe they hold the lock.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
import time
from contextlib import AbstractContextManager, nullcontext, suppress
from pathlib import Path

from ditdata.common.dist import launch_env
from ditdata.common.errors import UserError

LOCK_FILE = ".ditkit.lock"


def closed_in_forked_children() -> set[int]:
    """A set for the lock descriptors a module holds: whatever it holds when the process
    forks is closed in the child right after the fork (the parent's locks stay: closing a
    shared descriptor does not release them; see the module docstring)."""
    fds: set[int] = set()

    def close_all() -> None:
        for fd in list(fds):
            with suppress(OSError):
                os.close(fd)
        fds.clear()

    os.register_at_fork(after_in_child=close_all)
    return fds


_held = closed_in_forked_children()  # descriptors of the locks this process holds


class DirectoryBusy(UserError):
    """Another live process is writing the same output directory."""


class DirLock:
    """An exclusive, non-blocking lock on `directory` (created if missing) for `what`
    (the command, e.g. "dittrain run"); see the module docstring."""

    def __init__(self, directory, what: str):
        self.dir = Path(directory)
        self.path = self.dir / LOCK_FILE
        self.what = what
        self.fd: int | None = None
        self.created = False

    def acquire(self) -> DirLock:
        self.created = not self.dir.exists()
        self.dir.mkdir(parents=True, exist_ok=True)
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise DirectoryBusy(self._busy_message()) from None  # (we did not create it)
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # we locked a file that was unlinked meanwhile: take the new one
        else:
            raise DirectoryBusy(f"{self.dir}: could not take {self.path.name} (it keeps being replaced)")
        self.fd = fd
        _held.add(fd)
        holder = {"pid": os.getpid(), "command": self.what, "host": socket.gethostname(),
                  "since": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        return self

    def _busy_message(self) -> str:
        holder = _read_holder(self.path)
        who = (f"{holder.get('command') or 'another process'} (pid {holder.get('pid')}"
               f"{', host ' + holder['host'] if holder.get('host') not in (None, socket.gethostname()) else ''}"
               f"{', since ' + holder['since'] if holder.get('since') else ''})"
               if holder else "another process (pid not yet recorded)")
        return (f"{self.dir} is in use by {who}; two writers must not share it: wait for it to "
                f"finish or stop it, or choose another output")

    def release(self) -> None:
        """Drop the lock. A directory this lock created and that holds nothing else is
        removed with its lock file, so a run that failed before writing leaves no trace."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        _held.discard(fd)
        try:
            untouched = self.created and [p.name for p in self.dir.iterdir()] == [LOCK_FILE]
            if untouched:
                self.path.unlink(missing_ok=True)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        if untouched:
            try:
                self.dir.rmdir()
            except OSError:  # someone wrote into it meanwhile: leave it
                pass

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


def rank_zero_lock(directory, what: str) -> AbstractContextManager:
    """DirLock(directory, what) on rank 0 of a torchrun job (a single process is rank 0), nothing
    on the other ranks: they write the same output, so one lock stands for the job. Rank 0 takes
    it before the ranks meet, so the other ranks of a second job wait in the rendezvous (and are
    stopped with it) instead of writing."""
    return DirLock(directory, what) if launch_env().rank == 0 else nullcontext()


def _read_holder(path: Path) -> dict:
    """The holder's record; it writes it just after taking the lock, so wait a moment."""
    for _ in range(20):
        try:
            text = path.read_text(encoding="utf-8").strip()
            if text:
                rec = json.loads(text)
                if isinstance(rec, dict):
                    return rec
        except (OSError, ValueError):
            pass
        time.sleep(0.025)
    return {}
