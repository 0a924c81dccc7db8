"""The heartbeat: a stalled phase is reported with rank, phase and iteration. The watchdog runs on a
clock the test advances by hand, so each phase lasts exactly what the test says, however loaded
the machine (a real clock once added the time between two lines to a 0.5 s phase)."""

from dtgpt.faults.watchdog import Watchdog


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watchdog_after(durations: list[float], clock: Clock) -> Watchdog:
    """A watchdog (factor 10, at least 1 s; its thread stopped) that saw iterations of `durations` seconds."""
    dog = Watchdog(rank=3, factor=10.0, min_seconds=1.0, clock=clock)
    dog.close()  # check() is driven by hand
    for i, seconds in enumerate(durations):
        dog.enter("forward-backward", i + 1)
        clock.now += seconds
        dog.leave(record=True)
    return dog


def test_no_heartbeat_without_history_or_when_fast():
    clock = Clock()
    dog = watchdog_after([], clock)
    dog.enter("forward-backward", 1)
    assert dog.check(now=clock.now + 1000) is None  # no median yet
    dog = watchdog_after([0.5, 0.5, 0.5], clock)
    dog.enter("forward-backward", 4)
    assert dog.limit() == 5.0  # 10 x median 0.5 s
    assert dog.check(now=clock.now + 4.0) is None
    assert dog.check(now=clock.now + 5.0) is not None


def test_heartbeat_names_rank_phase_iteration_and_repeats():
    clock = Clock()
    dog = watchdog_after([0.2, 0.2, 0.2], clock)
    dog.enter("save-checkpoint", 7)
    start = clock.now
    line = dog.check(now=start + 2.5)
    assert line is not None
    assert "rank 3" in line and "'save-checkpoint'" in line and "iteration 7" in line and "2 s" in line
    assert dog.check(now=start + 2.9) is None  # not again within min_seconds
    assert dog.check(now=start + 3.6) is not None
    dog.leave()
    assert dog.check(now=start + 100) is None


def test_disabled_starts_no_thread():
    dog = Watchdog(rank=0, factor=0.0)
    assert dog._thread is None
    dog.close()
