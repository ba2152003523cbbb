"""The small helpers of liteinfer/utils.py that the processes' waits rest on."""
from __future__ import annotations

import os
import threading
import time

import pytest

from liteinfer.utils import ReadableWait, cpus_to_spin


def test_cpus_to_spin_keeps_two_cpus_for_the_rest():
    cpus = len(os.sched_getaffinity(0))
    assert cpus_to_spin(cpus - 2)
    assert not cpus_to_spin(cpus - 1)


@pytest.mark.parametrize("spin", [False, True])
def test_readable_wait_returns_once_input_arrives(spin):
    read_fd, write_fd = os.pipe()
    waiter = ReadableWait(read_fd, spin)
    returned = threading.Event()

    def wait() -> None:
        waiter.wait()
        returned.set()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    if spin:  # it spins until the byte is written
        time.sleep(0.05)
        assert not returned.is_set()
    os.write(write_fd, b"x")
    assert returned.wait(5)
    assert os.read(read_fd, 1) == b"x"
    os.close(read_fd)
    os.close(write_fd)


def test_a_spinning_wait_ends_when_the_writer_closes():
    read_fd, write_fd = os.pipe()
    waiter = ReadableWait(read_fd, spin=True)
    thread = threading.Thread(target=waiter.wait, daemon=True)
    thread.start()
    time.sleep(0.05)
    assert thread.is_alive()
    os.close(write_fd)
    thread.join(5)
    assert not thread.is_alive()
    assert os.read(read_fd, 1) == b""
    os.close(read_fd)


def test_a_spinning_wait_gives_up_after_its_bound():
    """A peer gone quiet (the last constrained request finished, nothing more to say) leaves
    the waiter to its blocking read once max_spin_s has passed."""
    read_fd, write_fd = os.pipe()
    start = time.monotonic()
    ReadableWait(read_fd, spin=True, max_spin_s=0.05).wait()
    assert 0.05 <= time.monotonic() - start < 5
    os.close(read_fd)
    os.close(write_fd)
