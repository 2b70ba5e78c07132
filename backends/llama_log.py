"""llama.cpp's own log lines, on stderr at the level they were logged at.

llama-cpp-python 0.3.36 maps ggml's log levels from an older enum: llama.cpp's warnings
print as errors and its errors are hidden (as debug). Among the warnings is the line
llama.cpp logs for every step the engine cuts ("removing memory module entries"), a
step that the trace records anyway; a step cut mid-graph also logs errors ("failed to
compute graph"), which while a cut is in effect are the cut's and print as warnings. This
callback reads ggml.h's enum as it is now and prints errors only unless verbose, as
llama-cpp-python means to.
"""
from __future__ import annotations

import logging
import sys

# enum ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the last line)
GGML_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
GGML_CONT = 5


class NativeLog:
    """Prints a line at or above `threshold`; a continuation takes its line's level."""

    def __init__(self) -> None:
        self.threshold = logging.ERROR
        self._last = logging.ERROR
        self.cutting = False  # a step is being cut (backends/step_cutter.py): its errors are the cut's

    def __call__(self, level: int, text: bytes | None, user_data: object = None) -> None:
        lvl = self._last if level == GGML_CONT else GGML_LEVELS.get(level, logging.ERROR)
        self._last = lvl = min(lvl, logging.WARNING) if self.cutting else lvl
        if lvl >= self.threshold and text:
            sys.stderr.write(text.decode("utf-8", "replace"))
            sys.stderr.flush()


NATIVE_LOG = NativeLog()
_installed = None  # the ctypes callback, kept alive while llama.cpp may call it


def route_native_logs(llama_cpp, verbose: bool) -> None:
    """Install the callback (once per process) and set what it prints: all when verbose."""
    global _installed
    NATIVE_LOG.threshold = logging.DEBUG if verbose else logging.ERROR
    if _installed is None:
        _installed = llama_cpp.llama_log_callback(NATIVE_LOG)
        llama_cpp.llama_log_set(_installed, None)
