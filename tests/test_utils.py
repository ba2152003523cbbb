"""The small helpers of liteinfer/utils.py that the processes' waits rest on."""
from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest

from liteinfer.utils import ReadableWait, cpus_to_spin, free_device_memory


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


def _engine_in_a_cycle(model_dir) -> weakref.ref:
    """Builds an engine whose core sits in a reference cycle (as callbacks make one), drops
    it, and returns a weak reference to the core."""
    from liteinfer import LLM
    llm = LLM(str(model_dir), dtype="float32", device="cpu", max_model_len=64)
    assert gc.get_freeze_count() > 0, "the engine left the heap to the cyclic collector"
    core = llm.engine.core
    core.cycle = core
    ref = weakref.ref(core)
    del llm, core
    gc.collect()
    return ref


def test_a_frozen_engine_is_collected_by_free_device_memory(tiny_llama_dir):
    ref = _engine_in_a_cycle(tiny_llama_dir)
    assert ref() is not None, "a plain collection reached the frozen engine"
    free_device_memory()
    assert ref() is None and gc.get_freeze_count() == 0


def test_a_new_engine_collects_the_frozen_garbage_of_an_old_one(tiny_llama_dir):
    from liteinfer import LLM
    ref = _engine_in_a_cycle(tiny_llama_dir)
    LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=64)
    assert ref() is None
