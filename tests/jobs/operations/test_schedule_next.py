"""When the scheduler starts a round (jobs.operations.schedule.next_step), at explicit UTC times: no sleeping,
no Ray. The loop in the scheduler actor is this function called again after each wait."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from jobs.operations.schedule import next_step
from jobs.operations.schedule_config import Trigger


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


def never() -> bool:
    raise AssertionError("the prefix was listed when nothing depended on it")


def test_cron_fires_at_its_utc_time_and_not_before():
    trig = Trigger(cron="0 3 * * *", poll_s=60)
    first = next_step(trig, ts("2026-11-24 01:30:00"), None, [], never)
    assert first.trigger is None and first.cron_due == ts("2026-11-24 03:00:00")  # no catch-up of earlier ticks
    assert first.wait_s == 60  # at most one poll between decisions
    close = next_step(trig, ts("2026-11-24 02:59:30"), first.cron_due, [], never)
    assert close.trigger is None and close.wait_s == 30  # wakes at the tick, not a poll later
    tick = next_step(trig, ts("2026-11-24 03:00:00"), close.cron_due, [], never)
    assert tick.trigger == "cron" and tick.cron_due == ts("2026-11-25 03:00:00") and tick.wait_s == 0
    after = next_step(trig, ts("2026-11-24 03:00:05"), tick.cron_due, [], never)
    assert after.trigger is None  # one round per tick


def test_cron_is_read_in_utc_whatever_the_local_zone(monkeypatch):
    import time

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        step = next_step(Trigger(cron="0 3 * * *"), ts("2026-11-24 01:30:00"), None, [], never)
        assert step.cron_due == ts("2026-11-24 03:00:00")
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_a_tick_during_a_round_runs_once_after_it_not_beside_it():
    trig = Trigger(cron="*/10 * * * *", poll_s=60)
    due = ts("2026-11-24 03:10:00")
    running = [{"round": 4, "status": "running", "started_ts": ts("2026-11-24 03:05:00")}]
    # 03:10 and 03:20 fall while round 4 (from a --once elsewhere, or this loop) runs: nothing starts
    for now in ("2026-11-24 03:10:00", "2026-11-24 03:20:00", "2026-11-24 03:25:00"):
        step = next_step(trig, ts(now), due, running, never)
        assert step.trigger is None and step.cron_due == due and "round 4 is running" in step.why
    # round 4 ended at 03:26: the tick it covered runs now, once; the next one is the next tick after now
    done = [{**running[0], "status": "promoted"}]
    step = next_step(trig, ts("2026-11-24 03:26:00"), due, done, never)
    assert step.trigger == "cron" and step.cron_due == ts("2026-11-24 03:30:00")
    assert next_step(trig, ts("2026-11-24 03:26:01"), step.cron_due, done, never).trigger is None


def test_a_round_left_running_for_a_day_is_taken_for_dead():
    trig = Trigger(cron="0 * * * *")
    stale = [{"round": 1, "status": "running", "started_ts": ts("2026-11-22 03:00:00")}]
    assert next_step(trig, ts("2026-11-24 04:00:00"), ts("2026-11-24 04:00:00"), stale, never).trigger == "cron"


def test_watch_polls_and_starts_a_round_on_new_files():
    trig = Trigger(watch="s3://corpora/new/", poll_s=30)
    quiet = next_step(trig, 1000.0, None, [], lambda: False)
    assert quiet.trigger is None and quiet.cron_due is None and quiet.wait_s == 30
    new = next_step(trig, 1030.0, None, [], lambda: True)
    assert new.trigger == "watch" and new.wait_s == 0
    busy = [{"round": 1, "status": "running", "started_ts": 1030.0}]
    assert next_step(trig, 1060.0, None, busy, never).trigger is None  # not even listed while one runs


def test_after_a_failed_round_new_files_wait_retry_after_s_but_cron_does_not():
    failed = [{"round": 1, "status": "failed", "started_ts": 1000.0}]
    trig = Trigger(watch="s3://corpora/new/", poll_s=60, retry_after_s=600)
    step = next_step(trig, 1500.0, None, failed, never)
    assert step.trigger is None and step.wait_s == 60 and "in 100 s" in step.why
    assert next_step(trig, 1560.0, None, failed, never).wait_s == 40  # wakes when the wait is over
    assert next_step(trig, 1600.0, None, failed, lambda: True).trigger == "watch"
    # a cron tick is a round the schedule asked for: it runs even right after a failure
    both = Trigger(cron="*/10 * * * *", watch="s3://corpora/new/", retry_after_s=3600)
    now = ts("2026-11-24 03:10:00")
    failed = [{"round": 1, "status": "failed", "started_ts": now - 60}]
    assert next_step(both, now, now, failed, never).trigger == "cron"


@pytest.mark.parametrize("cron", ["0 3 * * *", "*/15 * * * 1-5"])
def test_the_loop_over_a_day_starts_one_round_per_tick(cron):
    """The scheduler loop replayed with a clock: decide, 'sleep' wait_s, decide again; each round
    takes 5 minutes. Every tick of the day makes exactly one round, none overlap."""
    from croniter import croniter

    trig = Trigger(cron=cron, poll_s=300)
    start, end = ts("2026-11-24 00:00:00"), ts("2026-11-25 00:00:00")
    now, due, rounds, started = start, None, [], []
    while now < end:
        step = next_step(trig, now, due, rounds, never)
        due = step.cron_due
        if step.trigger:
            started.append(now)
            rounds.append({"round": len(rounds) + 1, "status": "promoted", "started_ts": now})
            now += 300  # the round runs in the loop's thread
        now += max(step.wait_s, 1.0)
    it = croniter(cron, datetime.fromtimestamp(start, timezone.utc))
    ticks = []
    while (t := it.get_next(float)) < end:
        ticks.append(t)
    assert started == ticks
