"""A deadline for one llama.cpp step: its abort callback, read between graph nodes.

llama.cpp asks `abort_callback(data)` before each node of a step's graph on the thread
that called `llama_decode`, and on true ends the step: `llama_decode` returns 2 and drops
the cache cells of the micro-batch it was computing. The callback runs inside the
compute loop with the GIL released, so it must not be Python (a Python callback would
take the GIL at every node, and wait behind any other thread that holds it). It is
libc's `strlen` over a two-byte buffer: 0 while the flag is clear, 1 (true) once a timer
thread has written one byte into it at the deadline, or `cut()` has from another thread
(a foreground prompt arrived while a background step runs).
"""
from __future__ import annotations

import ctypes
import threading
import time

from dlfp.backends.llama_log import NATIVE_LOG


class StepCutter:
    def __init__(self, llama_cpp, ctx) -> None:
        self.flag = ctypes.create_string_buffer(2)  # b"" clear, b"x" cut
        libc = ctypes.CDLL(None)
        self._callback = llama_cpp.ggml_abort_callback(ctypes.cast(libc.strlen, ctypes.c_void_p).value)
        llama_cpp.llama_set_abort_callback(ctx, self._callback, ctypes.cast(self.flag, ctypes.c_void_p))
        self._wake = threading.Condition()
        self._deadline: float | None = None
        self._armed = False  # a step that may be cut is running
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dlfp-step-cutter", daemon=True)
        self._thread.start()

    def arm(self, limit_s: float | None) -> None:
        """Cut the step that starts now once it has run `limit_s` (at once where <= 0; None:
        no deadline, only `cut()`)."""
        with self._wake:
            self._armed, self.flag.value = True, b""
            self._deadline = None if limit_s is None or limit_s <= 0 else time.perf_counter() + limit_s
            if limit_s is not None and limit_s <= 0:
                self._cut_now()
            self._wake.notify()

    def cut(self) -> None:
        """Cut the armed step now (any thread). Unarmed, nothing: the flag must never outlive its
        step, or the next step, which no one asked to cut, would end at its first node."""
        with self._wake:
            if self._armed:
                self._cut_now()

    def disarm(self) -> None:
        with self._wake:
            self._armed, self._deadline = False, None
            self.flag.value, NATIVE_LOG.cutting = b"", False

    def _cut_now(self) -> None:  # under self._wake
        self.flag.value, self._deadline, NATIVE_LOG.cutting = b"x", None, True

    def close(self) -> None:
        with self._wake:
            self._closed, self._deadline = True, None
            self._wake.notify()

    def _run(self) -> None:
        with self._wake:
            while not self._closed:
                if self._deadline is None:
                    self._wake.wait()
                    continue
                left = self._deadline - time.perf_counter()
                if left > 0:
                    self._wake.wait(left)
                else:
                    self._cut_now()
