"""A deadline for one llama.cpp step: its abort callback, read between graph nodes.

llama.cpp asks `abort_callback(data)` before each node of a step's graph on the thread
that called `llama_decode`, and on true ends the step: `llama_decode` returns 2 and drops
the cache cells of the micro-batch it was computing. The callback runs inside the
compute loop with the GIL released, so it must not be Python (a Python callback would
take the GIL at every node, and wait behind any other thread that holds it). It is
libc's `strlen` over a two-byte buffer: 0 while the flag is clear, 1 (true) once a timer
thread has written one byte into it at the deadline.
"""
from __future__ import annotations

import ctypes
import threading
import time


class StepCutter:
    def __init__(self, llama_cpp, ctx) -> None:
        self.flag = ctypes.create_string_buffer(2)  # b"" clear, b"x" cut
        libc = ctypes.CDLL(None)
        self._callback = llama_cpp.ggml_abort_callback(ctypes.cast(libc.strlen, ctypes.c_void_p).value)
        llama_cpp.llama_set_abort_callback(ctx, self._callback, ctypes.cast(self.flag, ctypes.c_void_p))
        self._wake = threading.Condition()
        self._deadline: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dlfp-step-cutter", daemon=True)
        self._thread.start()

    def arm(self, limit_s: float) -> None:
        """Cut the step that starts now once it has run `limit_s` (at once where <= 0)."""
        with self._wake:
            self.flag.value = b"x" if limit_s <= 0 else b""
            self._deadline = None if limit_s <= 0 else time.perf_counter() + limit_s
            self._wake.notify()

    def disarm(self) -> None:
        with self._wake:
            self._deadline = None
            self.flag.value = b""

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
                    self.flag.value, self._deadline = b"x", None
