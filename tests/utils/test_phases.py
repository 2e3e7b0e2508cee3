"""Phase timers: nested phases are charged exclusively, a step's phases add up to its CPU time, and without an
active timer a phase costs one global read."""

import time

from deepspec.utils.phases import STEP_PHASES, PhaseTimer, phase, span_cost_s


def burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_nested_phases_are_charged_exclusively_and_add_up():
    with PhaseTimer() as timer:
        start = time.process_time()
        with phase("loss"):
            burn(0.02)
            with phase("forward"):
                burn(0.03)
        burn(0.01)  # in no phase: `other`
        record = timer.take()
        spent = time.process_time() - start
    phases = record["phase_cpu_s"]
    assert list(phases) == ["forward", "loss", "other"]  # the step's phase order
    assert 0.03 <= phases["forward"] < 0.04 and 0.02 <= phases["loss"] < 0.03 and 0.01 <= phases["other"] < 0.02
    assert abs(sum(phases.values()) - spent) < 0.002
    assert record["phase_spans"] == 2 and record["user_s"] + record["sys_s"] > 0.05
    again = timer.take()  # the next interval starts empty
    assert again["phase_spans"] == 0 and set(again["phase_cpu_s"]) == {"other"}


def test_phase_without_a_timer_records_nothing():
    assert phase("data") is phase("loss")  # one shared no-op
    with phase("data"):
        burn(0.001)
    with PhaseTimer() as timer:
        pass
    assert timer.take()["phase_spans"] == 0


def test_a_timed_phase_costs_microseconds():
    assert span_cost_s(2000) < 50e-6
    assert STEP_PHASES[-1] == "other"
