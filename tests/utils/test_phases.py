"""Phase timers: nested phases are charged exclusively, a step's phases add up to its CPU time, and without an
active timer a phase costs one global read. The timer's clock is replaced by one the test advances, so the
checks are exact and hold on a loaded machine (what a phase costs is measured by `deepspec bench train`)."""

from types import SimpleNamespace

import pytest

import deepspec.utils.phases as phases_module
from deepspec.utils.phases import STEP_PHASES, PhaseTimer, phase, span_cost_s


@pytest.fixture
def clock(monkeypatch):
    """The process CPU clock the timer reads; `clock.burn(s)` spends s seconds on it."""
    fake = SimpleNamespace(now=100.0)
    fake.burn = lambda seconds: setattr(fake, "now", fake.now + seconds)
    monkeypatch.setattr(phases_module, "time", SimpleNamespace(process_time=lambda: fake.now))
    return fake


def test_nested_phases_are_charged_exclusively_and_add_up(clock):
    with PhaseTimer() as timer:
        start = clock.now
        with phase("loss"):
            clock.burn(0.02)
            with phase("forward"):
                clock.burn(0.03)
        clock.burn(0.01)  # in no phase: `other`
        record = timer.take()
        spent = clock.now - start
    phases = record["phase_cpu_s"]
    assert list(phases) == ["forward", "loss", "other"]  # the step's phase order
    assert phases == pytest.approx({"forward": 0.03, "loss": 0.02, "other": 0.01}, abs=1e-9)
    assert sum(phases.values()) == pytest.approx(spent, abs=1e-9)
    assert record["phase_spans"] == 2 and {"user_s", "sys_s", "minor_faults"} <= set(record)
    again = timer.take()  # the next interval starts empty
    assert again["phase_spans"] == 0 and again["phase_cpu_s"] == {"other": 0.0}


def test_phase_without_a_timer_records_nothing(clock):
    assert phase("data") is phase("loss")  # one shared no-op
    with phase("data"):
        clock.burn(0.001)
    with PhaseTimer() as timer:
        pass
    assert timer.take()["phase_spans"] == 0


def test_the_span_cost_leaves_no_timer_active():
    assert span_cost_s(20) >= 0.0
    assert phase("data") is phase("loss")
    assert STEP_PHASES[-1] == "other"
