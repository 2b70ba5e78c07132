"""The process that owns the ExecuTorch runtime (see executorch.py for why).

Protocol over a multiprocessing Pipe, one request then one reply:
  ("step", [(slot, token_ids, start, wants_logits), ...])
      -> ("ok", {slot: logits float32}, duration_s, device_duration_s | None)
  ("close",) -> the process exits
Any failure replies ("error", message); the process keeps serving.

Each slot has its own loaded Program: two Programs from one file keep separate
mutable buffers (KV caches), while two Methods of one Program would share one.
"""
from __future__ import annotations

import time
import warnings

# ETDump per-execute timing: the event ExecuTorch records around Method::execute.
EXECUTE_EVENT = "Method::execute"


def serve(conn, pte_path: str, n_slots: int, method: str, n_threads: int, etdump: bool) -> None:
    warnings.filterwarnings("ignore")
    try:
        slots = _load(pte_path, n_slots, method, n_threads, etdump)
    except Exception as exc:  # report a load failure as one line, then exit
        conn.send(("error", f"ExecuTorch could not load {pte_path}: {exc}"))
        return
    conn.send(("ready", _describe(n_threads)))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "close":
            return
        try:
            conn.send(("ok", *_step(slots, msg[1], etdump, pte_path)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _load(pte_path: str, n_slots: int, method: str, n_threads: int, etdump: bool) -> list:
    import torch
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime

    torch.set_num_threads(1)  # torch only builds input tensors here; XNNPACK does the work
    portable_lib._unsafe_reset_threadpool(n_threads)
    runtime = Runtime.get()
    slots = []
    for _ in range(n_slots):
        program = runtime.load_program(pte_path, enable_etdump=etdump)
        slots.append((program, program.load_method(method)))
    return slots


def _step(slots: list, items: list, etdump: bool, pte_path: str):
    import torch

    logits = {}
    t_start = time.perf_counter()
    for slot, token_ids, start, wants_logits in items:
        out = slots[slot][1].execute([torch.tensor([token_ids], dtype=torch.long), torch.tensor([start])])
        # execute() returns when the work is done and the output is in host memory.
        if wants_logits:
            logits[slot] = out[0][0].numpy().astype("float32", copy=True)
    duration = time.perf_counter() - t_start
    device = _etdump_seconds({slot for slot, *_ in items}, slots, pte_path) if etdump else None
    return logits, duration, device


def _etdump_seconds(touched: set[int], slots: list, pte_path: str) -> float | None:
    """Sum of this step's Method::execute spans, read back from each touched Program's ETDump.

    Costs a flatc decode per Program (~0.4 s here), after the step's timing: for checks, not serving.
    """
    import os
    import tempfile

    from executorch.devtools.etdump.serialize import deserialize_from_etdump_flatcc

    total_ns = 0
    with tempfile.TemporaryDirectory() as d:
        for slot in touched:
            path = os.path.join(d, f"{slot}.etdp")
            slots[slot][0].write_etdump_result_to_file(path, os.path.join(d, f"{slot}.bin"))
            dump = deserialize_from_etdump_flatcc(open(path, "rb").read())
            spans = [
                e.profile_event for block in dump.run_data for e in block.events
                if e.profile_event is not None and e.profile_event.name == EXECUTE_EVENT
            ]
            if not spans:
                return None
            # The dump accumulates; this step's execute on this slot is the newest one.
            ticks = spans[-1].end_time - spans[-1].start_time
            total_ns += ticks  # ExecuTorch's Linux PAL counts ticks in nanoseconds
    return total_ns / 1e9


def _describe(n_threads: int) -> dict:
    from importlib.metadata import version

    return {"executorch": version("executorch"), "torch": version("torch"), "n_threads": n_threads}
