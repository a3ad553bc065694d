"""``kvtier.connector.save_batches``: saves queued together are written together, each save's future
ends once, and a save refused or cancelled is never written."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.connector.save_batches import SaveBatches


def held_writer() -> tuple[threading.Event, list[list[str]], object]:
    """A ``write`` that waits for the event before recording each batch's keys."""
    gate = threading.Event()
    written: list[list[str]] = []

    def write(batch) -> None:
        gate.wait(10)
        written.append([key for save in batch for key, *_ in save.pages])

    return gate, written, write


def test_saves_queued_behind_a_batch_go_together_in_the_next():
    gate, written, write = held_writer()
    batches = SaveBatches(1, "test-save-batches", write)
    first = batches.submit([("a", 0, 1, False)], None, 100)
    time.sleep(0.05)  # the first batch is taken and held
    later = [batches.submit([(key, 0, 2, False)], None, 100) for key in ("b", "c", "d")]
    gate.set()
    for future in [first, *later]:
        assert future.result(10) is None
    assert written == [["a"], ["b", "c", "d"]]
    batches.shutdown()


def test_a_failed_batch_fails_each_of_its_saves():
    def write(batch) -> None:
        raise OSError("the store is gone")

    batches = SaveBatches(1, "test-save-batches", write)
    futures = [batches.submit([(key, 0, 1, False)], None, 1) for key in "xy"]
    for future in futures:
        with pytest.raises(OSError, match="gone"):
            future.result(10)
    batches.shutdown()


def test_a_save_submitted_after_shutdown_is_refused_and_never_written():
    """Before, the refused save stayed queued: a drain queued earlier wrote it after its caller had
    been told it was not taken (and may have let its pages go)."""
    gate, written, write = held_writer()
    batches = SaveBatches(1, "test-save-batches", write)
    batches.submit([("a", 0, 1, False)], None, 1)
    time.sleep(0.05)
    batches.submit([("b", 0, 2, False)], None, 1)  # its drain waits behind the held batch
    stopping = threading.Thread(target=batches.shutdown)
    stopping.start()
    time.sleep(0.05)
    with pytest.raises(RuntimeError):
        batches.submit([("late", 0, 3, False)], None, 1)
    gate.set()
    stopping.join(10)
    assert written == [["a"], ["b"]]


def test_a_save_being_written_cannot_be_cancelled_and_its_batch_ends_whole():
    """Before, a cancel succeeded while the save's pages were being read, and the batch's other
    futures never ended (setting the cancelled one's result raised in the drain)."""
    gate, written, write = held_writer()
    batches = SaveBatches(1, "test-save-batches", write)
    held = batches.submit([("a", 0, 1, False)], None, 1)
    time.sleep(0.05)
    first, second = (batches.submit([(key, 0, 2, False)], None, 1) for key in "bc")
    assert first.cancel()  # still queued: never written
    gate.set()
    assert held.result(10) is None and second.result(10) is None
    time.sleep(0.05)
    gate.clear()
    third = batches.submit([("d", 0, 3, False)], None, 1)
    time.sleep(0.05)
    assert not third.cancel()  # taken: its pages may be being read
    gate.set()
    assert third.result(10) is None
    assert written == [["a"], ["c"], ["d"]]
    batches.shutdown()
