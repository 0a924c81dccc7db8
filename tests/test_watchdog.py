"""The heartbeat: a stalled phase is reported with rank, phase and iteration."""

from dtgpt.faults.watchdog import Watchdog


def test_no_heartbeat_without_history_or_when_fast():
    dog = Watchdog(rank=3, factor=10.0, min_seconds=1.0)
    dog.close()  # drive check() by hand with explicit times
    dog.enter("forward-backward", 1)
    assert dog.check(now=dog._started + 1000) is None  # no median yet
    for i in range(3):
        dog.enter("forward-backward", i + 1)
        dog._started -= 0.5  # each iteration took 0.5 s
        dog.leave(record=True)
    dog.enter("forward-backward", 4)
    assert abs(dog.limit() - 5.0) < 0.01  # 10 x median 0.5 s
    assert dog.check(now=dog._started + 4.0) is None


def test_heartbeat_names_rank_phase_iteration_and_repeats():
    dog = Watchdog(rank=3, factor=10.0, min_seconds=1.0)
    dog.close()
    for i in range(3):
        dog.enter("forward-backward", i + 1)
        dog._started -= 0.2
        dog.leave(record=True)
    dog.enter("save-checkpoint", 7)
    start = dog._started
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
