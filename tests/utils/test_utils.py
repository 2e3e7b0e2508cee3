"""Process set-up and fault injection are explicit values, not environment side effects."""

import pytest

from deepspec.utils.dist import Launch
from deepspec.utils.faults import FaultInjection


def test_launch_reads_a_launchers_variables_or_is_a_single_process():
    assert Launch.from_environ({}) == Launch(rank=0, local_rank=0, world_size=1, launched=False)
    launched = Launch.from_environ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_PORT": "1"})
    assert launched == Launch(rank=3, local_rank=1, world_size=4, launched=True)


def test_fault_injection_stops_after_n_units_only_when_asked():
    assert not FaultInjection().should_stop(10**6)
    faults = FaultInjection(stop_after=2)
    assert not faults.should_stop(1) and faults.should_stop(2)
    with pytest.raises(ValueError, match="faults.stop_after"):
        FaultInjection(stop_after=-1)
