"""fdatasync without a thread, through Linux's native AIO.

`io_submit` with IOCB_CMD_FDSYNC runs the sync in the kernel's own worker and signals its end on
an eventfd the event loop watches. Handing the journal's shared fdatasync to a thread of ours
instead costs, at each hand-off, waking that thread, passing the GIL to it and back, and waking
the loop from it: about 0.06 ms of CPU per commit, and the loop's own system calls wait for the
GIL behind it. Here the loop submits the sync (a system call that queues it and returns) and goes
on; the eventfd becomes readable when the sync is done. Callers that ask while a sync of the same
file is in flight share the next one (group commit), as they share the sync thread's.

`AioSync.open()` is None where this cannot work (not Linux, an unknown architecture, a kernel
or a seccomp profile that refuses `io_setup`, the system's `aio-max-nr` reached): the journal
then keeps its sync thread. The system calls are made through `ctypes.PyDLL`, which keeps the
GIL: each returns at once, and giving the GIL away around it would invite the very hand-offs
this avoids.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import platform
import struct
from collections.abc import Callable

log = logging.getLogger("gateway.store")

# io_setup, io_destroy, io_getevents, io_submit
_NUMBERS = {
    "x86_64": (206, 207, 208, 209),
    "aarch64": (0, 1, 4, 2),
    "arm64": (0, 1, 4, 2),
}
_IOCB_CMD_FDSYNC = 3
_IOCB_FLAG_RESFD = 1
_IOCB = struct.Struct("<QIIHhIQQqQII")  # struct iocb (linux/aio_abi.h), 64 bytes
_EVENT = struct.Struct("<QQqq")  # struct io_event: data, obj, res, res2
_EVENTS = 64
# Syncs in flight at once, at most: one per file, and a journal has two. Each context takes
# this many of the system-wide fs.aio-max-nr (65,536 by default), one context per store.
_SLOTS = 16


def _syscall() -> Callable[..., int] | None:
    try:
        call = ctypes.PyDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


class AioSync:
    """Shared fdatasyncs of files, for coroutines of one event loop."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, call: Callable[..., int], numbers: tuple[int, ...]
    ) -> None:
        self.loop = loop
        self._call = call
        self._setup, self._destroy, self._getevents, self._submit_nr = numbers
        self._context = ctypes.c_ulong(0)
        if call(self._setup, _SLOTS, ctypes.byref(self._context)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), "io_setup")
        try:
            self._eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError:
            call(self._destroy, self._context)
            raise
        self._iocb = ctypes.create_string_buffer(_IOCB.size)
        self._iocbs = (ctypes.c_void_p * 1)(ctypes.addressof(self._iocb))
        self._events = ctypes.create_string_buffer(_EVENT.size * _EVENTS)
        self._pending: dict[int, list[asyncio.Future[None]]] = {}  # fd -> waiting for the next sync
        self._flight: dict[int, list[asyncio.Future[None]]] = {}  # fd -> the sync under way
        self.submitted = 0  # syncs submitted (tests count them)
        self.closed = False
        try:
            loop.add_reader(self._eventfd, self._ready)
        except BaseException:
            call(self._destroy, self._context)
            os.close(self._eventfd)
            raise

    @classmethod
    def open(cls, loop: asyncio.AbstractEventLoop) -> AioSync | None:
        numbers = _NUMBERS.get(platform.machine())
        call = _syscall() if numbers is not None and hasattr(os, "eventfd") else None
        if call is None or numbers is None:
            return None
        try:
            return cls(loop, call, numbers)
        except (OSError, NotImplementedError, RuntimeError) as exc:
            log.info("no native AIO fdatasync (%s): the journal syncs in a thread", exc)
            return None

    def sync(self, fd: int) -> asyncio.Future[None]:
        """Done once an fdatasync of `fd` that began after this call has ended."""
        if self.closed:
            raise RuntimeError("the AIO context is closed")
        future = self.loop.create_future()
        self._pending.setdefault(fd, []).append(future)
        if fd not in self._flight:
            self._start(fd)
        return future

    def _start(self, fd: int) -> None:
        waiting = self._pending.pop(fd)
        # aio_data = the fd (one sync per file in flight), opcode, the file, flags, the eventfd
        _IOCB.pack_into(
            self._iocb, 0, fd, 0, 0, _IOCB_CMD_FDSYNC, 0, fd, 0, 0, 0, 0, _IOCB_FLAG_RESFD, self._eventfd
        )
        if self._call(self._submit_nr, self._context, 1, self._iocbs) != 1:
            err = ctypes.get_errno()
            resolve(waiting, NotSubmitted(err, os.strerror(err)))
            return
        self.submitted += 1
        self._flight[fd] = waiting

    def _ready(self) -> None:
        try:
            os.eventfd_read(self._eventfd)
        except BlockingIOError:
            return
        while self._flight and self._collect(0, restart=True) == _EVENTS:
            pass

    def _collect(self, at_least: int, *, restart: bool) -> int:
        """Settle the syncs that ended (waiting for `at_least` of them); return how many ended.

        With `restart`, start the next sync of a file someone asked for meanwhile.
        """
        got = self._call(self._getevents, self._context, at_least, _EVENTS, self._events, None)
        while got < 0 and ctypes.get_errno() == errno.EINTR:  # a signal: the events are still there
            got = self._call(self._getevents, self._context, at_least, _EVENTS, self._events, None)
        for i in range(max(got, 0)):
            fd, _, result, _ = _EVENT.unpack_from(self._events, i * _EVENT.size)
            resolve(self._flight.pop(fd, []), OSError(-result, os.strerror(-result)) if result < 0 else None)
            if restart and fd in self._pending:
                self._start(fd)
        return got

    def close(self) -> None:
        """On the loop: end the syncs in flight, then release the context.

        The waiters of syncs in flight get their outcome; waiters of syncs not begun get
        NotSubmitted (nothing waits at a clean close).
        """
        if self.closed:
            return
        self.closed = True
        if not self.loop.is_closed():
            self.loop.remove_reader(self._eventfd)
        while self._flight and self._collect(1, restart=False) > 0:
            pass
        self._call(self._destroy, self._context)
        os.close(self._eventfd)
        left = [f for waiting in (*self._flight.values(), *self._pending.values()) for f in waiting]
        self._flight.clear()
        self._pending.clear()
        resolve(left, NotSubmitted(errno.ESHUTDOWN, "closed before the sync began"))


class NotSubmitted(OSError):
    """`io_submit` refused the sync: nothing was synced, and nothing is known to be lost.

    The caller syncs another way.
    """


def resolve(futures: list[asyncio.Future[None]], error: OSError | None) -> None:
    """Give each waiter not gone yet the sync's outcome (a fresh exception each)."""
    for future in futures:
        if future.done():
            continue
        if error is not None:
            future.set_exception(type(error)(error.errno, error.strerror))
        else:
            future.set_result(None)
