"""The process that owns the ExecuTorch runtime (see executorch.py for why).

Protocol over a multiprocessing Pipe, one request then one reply:
  ("step", [(slot, token_ids, start, wants_logits), ...])
      -> ("ok", {slot: logits float32}, duration_s, device_duration_s | None)
  ("close",) -> the process exits
Any failure replies ("error", message); the process keeps serving.

Per-sequence layout: each slot has its own loaded Program (two Programs from one
file keep separate mutable buffers, i.e. KV caches; two Methods of one Program would
share one), and a step's items run one execute after another. Packed layout: ONE
Program whose cache holds every slot; a step's items are packed into one execute
(tokens, slots, positions, rows) and its logits rows are handed back per sequence.
"""
from __future__ import annotations

import time
import warnings

# ETDump per-execute timing: the event ExecuTorch records around Method::execute.
EXECUTE_EVENT = "Method::execute"


def serve(conn, pte_path: str, n_slots: int, method: str, n_threads: int, etdump: bool, packed: bool = False) -> None:
    warnings.filterwarnings("ignore")
    try:
        slots = _load(pte_path, 1 if packed else n_slots, method, n_threads, etdump)
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
            step = _step_packed if packed else _step
            conn.send(("ok", *step(slots, msg[1], etdump, pte_path)))
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


def _step_packed(programs: list, items: list, etdump: bool, pte_path: str):
    """All items in one execute: each token tagged with its slot and position."""
    import torch

    tokens, slots, positions, rows, wanted = [], [], [], [], []
    for slot, token_ids, start, wants_logits in items:
        tokens += token_ids
        slots += [slot] * len(token_ids)
        positions += range(start, start + len(token_ids))
        if wants_logits:
            rows.append(len(tokens) - 1)  # the item's last token
            wanted.append(slot)
    inputs = [torch.tensor([tokens], dtype=torch.long), torch.tensor(slots, dtype=torch.long),
              torch.tensor(positions, dtype=torch.long), torch.tensor(rows or [len(tokens) - 1], dtype=torch.long)]
    t_start = time.perf_counter()
    out = programs[0][1].execute(inputs)[0]
    duration = time.perf_counter() - t_start
    logits = {slot: out[i].numpy().astype("float32", copy=True) for i, slot in enumerate(wanted)}
    device = _etdump_seconds({0}, programs, pte_path) if etdump else None
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
