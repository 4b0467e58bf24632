"""One job at a time on a background thread (runtime.background_slot): a second job is refused while the first
runs, results (and errors) come back to the owner in order, close stops the thread."""

from __future__ import annotations

import threading

from gossiploco.runtime.background_slot import BackgroundSlot


def test_one_job_at_a_time_results_and_errors_come_back_to_the_owner():
    slot = BackgroundSlot("test-slot")
    release = threading.Event()
    try:
        assert slot.submit("first", lambda: release.wait(10) and 1)
        assert slot.busy and not slot.submit("second", lambda: 2)  # refused while the first runs
        assert slot.take() == []
        release.set()
        assert slot.wait_idle(10) and not slot.busy
        [first] = slot.take()
        assert (first.tag, first.value, first.error) == ("first", 1, None) and first.seconds >= 0

        def broken():
            raise ValueError("members include unknown peers")

        assert slot.submit("broken", broken) and slot.wait_idle(10)
        [failed] = slot.take()
        assert failed.tag == "broken" and isinstance(failed.error, ValueError)  # handed back, never raised here
    finally:
        assert slot.close(10)
    assert not slot.submit("late", lambda: 3)  # closed: refused
    assert slot.close(1)  # idempotent
