"""What it costs to wake a process that sleeps on a pipe, against one that spins on it.

The parent writes a byte, then spins until the child's reply byte is back; the child either
blocks in read() (the kernel puts it to sleep) or spins on a non-blocking read. Between pings
the parent waits `gap` (busy), so a blocked child has slept that long when the byte comes.
Prints the round trip's p50 and p99 per mode and gap; with $OUT set, writes
$OUT/wakeup.json. The difference between the modes is what each sleep on a request's path
adds to its latency on this host (the engine core, the front ends and the grammar process
all wait on sockets or pipes).

    python scripts/bench_wakeup.py [--pings 2000]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time

import numpy as np

GAPS_S = (0.0, 0.0002, 0.002)


def echo(read_fd: int, write_fd: int, spin: bool) -> None:
    os.set_blocking(read_fd, not spin)
    while True:
        try:
            data = os.read(read_fd, 1)
        except BlockingIOError:
            continue
        if data != b"p":
            return
        os.write(write_fd, b"r")


def round_trips(spin: bool, gap: float, pings: int) -> list[float]:
    to_child, from_parent = os.pipe()
    from_child, to_parent = os.pipe()
    child = multiprocessing.get_context("fork").Process(
        target=echo, args=(to_child, to_parent, spin))
    child.start()
    os.set_blocking(from_child, False)
    times = []
    for _ in range(pings):
        until = time.perf_counter() + gap
        while time.perf_counter() < until:
            pass
        start = time.perf_counter()
        os.write(from_parent, b"p")
        while True:
            try:
                os.read(from_child, 1)
                break
            except BlockingIOError:
                pass
        times.append(time.perf_counter() - start)
    os.write(from_parent, b"q")
    child.join()
    for fd in (to_child, from_parent, from_child, to_parent):
        os.close(fd)
    return times[pings // 10:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pings", type=int, default=2000)
    args = ap.parse_args()
    report = {}
    for gap in GAPS_S:
        for spin in (False, True):
            t = np.array(round_trips(spin, gap, args.pings)) * 1e6
            key = f"gap_{gap * 1e3:g}ms_{'spin' if spin else 'block'}"
            report[key] = {"p50_us": round(float(np.median(t)), 1),
                           "p99_us": round(float(np.percentile(t, 99)), 1)}
            print(key, report[key], flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wakeup.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
