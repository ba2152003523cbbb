"""Small helpers shared by the engine's modules."""
from __future__ import annotations

import atexit
import gc
import os
import select
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


def ints_below(values: list, end: int) -> bool:
    """Whether every value is a plain int (not a bool) in [0, end), checked at C speed: a
    token-id prompt's ids one by one in Python take twice as long (journal item 71)."""
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) < end


def cpus_to_spin(spinners: int) -> bool:
    """Whether this machine can give each of `spinners` busy-waiting processes a CPU of its own
    and keep two for the rest (clients, tokenizer threads, the system). Below that a process
    that spins takes CPU time from the one it waits for."""
    return len(os.sched_getaffinity(0)) >= spinners + 2


class ReadableWait:
    """Spins until a descriptor has input (or its peer has closed it), where `spin`, for at
    most `max_spin_s`: a process asleep in the kernel takes tens of microseconds to wake (more
    on a virtual machine's idle CPUs), and each wake-up lands on the latency of whatever the
    message carries. The caller's blocking read does the rest of the waiting (all of it
    without `spin`), so a peer gone quiet costs no CPU after max_spin_s."""

    def __init__(self, fd: int, spin: bool, max_spin_s: float = 0.5):
        self.spin, self.max_spin_s = spin, max_spin_s
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def wait(self) -> None:
        if not self.spin:
            return
        deadline = time.monotonic() + self.max_spin_s
        while not self._poll.poll(0) and time.monotonic() < deadline:
            pass


def to_device(data: Sequence | np.ndarray, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """Host list or array -> device tensor; a pinned source lets the copy run without a stream
    sync."""
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.as_tensor(data, dtype=dtype).pin_memory().to(device, non_blocking=True)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def ragged_index(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of counts[i] items laid end to end: each item's group and its index within
    that group (e.g. a step's tokens: their sequence and offset in it)."""
    counts = np.asarray(counts, dtype=np.int64)
    group = np.repeat(np.arange(len(counts)), counts)
    return group, np.arange(len(group)) - (np.cumsum(counts) - counts)[group]


def freeze_heap() -> None:
    """Puts every object alive now (the model, the engine, the imported libraries) beyond the
    cyclic garbage collector's full collections, which a long run of steps triggers and which
    would otherwise walk all of them with the step loop stopped, the GPU idle behind it
    (docs/notes/journal.md, item 101). Garbage that an earlier call froze (a dropped engine's
    reference cycles) is collected first."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


# The interpreter's last collection, at exit, sees frozen objects only once they are unfrozen.
atexit.register(gc.unfreeze)


def free_device_memory() -> None:
    """Returns memory of objects just dropped (a model, a KV pool) to the device, frozen ones
    (`freeze_heap`) included."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def model_label(model: str) -> str:
    """How a model is named to users: a known name as given, a directory or file by its name."""
    return Path(model).name if Path(model).exists() else model
