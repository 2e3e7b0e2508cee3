"""Algorithm 1 (hardware-aware prefix scheduler), static/fixed policies and the SPS table."""

import json
import time

import numpy as np
import pytest
import torch

from deepspec.decoding.scheduler import (
    SPSTable,
    VerificationPolicy,
    fixed_lengths,
    load_or_profile,
    profile_sps,
    retrospective_prefix_lengths,
    schedule_prefix_lengths,
    static_threshold_lengths,
)

APPENDIX_A_SPS = {1: 1.0, 2: 0.5, 3: 0.45}.__getitem__


def test_two_requests_hand_computed():
    # a = [[0.9, 0.72], [0.5, 0.5]]; order (0,1) (0,2) (1,1) (1,2) (stable tie on 0.5).
    sps = {2: 10.0, 3: 9.0, 4: 8.0, 5: 6.0, 6: 5.0}.__getitem__
    # Theta: start 2*10 = 20; +0.9 -> 2.9*9 = 26.1; +0.72 -> 3.62*8 = 28.96; +0.5 -> 4.12*6 = 24.72 stop.
    confidence_RK = torch.tensor([[0.9, 0.8], [0.5, 1.0]], dtype=torch.float32)
    assert schedule_prefix_lengths(confidence_RK, sps) == [2, 0]


def test_early_stop_at_first_non_improving_admission_even_if_later_would_improve():
    # Appendix A case 1: Theta_0 = 1.0, Theta_1 = 1.8 * 0.5 = 0.9, Theta_2 = 2.52 * 0.45 = 1.134.
    confidence_RK = [[0.8, 0.9]]
    assert schedule_prefix_lengths(confidence_RK, APPENDIX_A_SPS) == [0]
    assert retrospective_prefix_lengths(confidence_RK, APPENDIX_A_SPS) == [2]
    # Case 2 (c_2 = 0): both stop at 0; a = 0 is not even a candidate.
    assert schedule_prefix_lengths([[0.8, 0.0]], APPENDIX_A_SPS) == [0]
    assert retrospective_prefix_lengths([[0.8, 0.0]], APPENDIX_A_SPS) == [0]


def test_equal_throughput_stops():
    # Theta_1 = 2 * 0.5 = 1.0 == Theta_0: not strictly better -> stop.
    assert schedule_prefix_lengths([[1.0, 1.0]], {1: 1.0, 2: 0.5, 3: 0.5}.__getitem__) == [0]


def test_flat_sps_admits_every_positive_survival_and_steep_sps_admits_none():
    confidence_RK = np.array([[0.9, 0.5, 0.0, 0.7], [0.2, 0.1, 0.3, 0.9], [1.0, 1.0, 1.0, 1.0]])
    assert schedule_prefix_lengths(confidence_RK, lambda b: 1.0) == [2, 4, 4]
    # SPS halves with every extra token: the first admission (a <= 1) can never pay for itself.
    assert schedule_prefix_lengths(confidence_RK, lambda b: 2.0 ** (-b)) == [0, 0, 0]


def test_max_lengths_cap_each_request():
    assert schedule_prefix_lengths([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]], lambda b: 1.0, max_lengths_R=[1, 3]) == [1, 3]
    with pytest.raises(ValueError, match=r"max_lengths_R must lie in \[0, 3\]"):
        schedule_prefix_lengths([[0.9, 0.9, 0.9]], lambda b: 1.0, max_lengths_R=[4])


def test_bad_confidences_raise():
    with pytest.raises(ValueError, match="must be finite and lie in"):
        schedule_prefix_lengths([[1.2]], lambda b: 1.0)
    with pytest.raises(ValueError, match="2-D"):
        schedule_prefix_lengths([0.5, 0.5], lambda b: 1.0)


def test_static_threshold_conditional_and_cumulative():
    confidence_RK = [[0.9, 0.8, 0.95, 0.3], [0.4, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]]
    assert static_threshold_lengths(confidence_RK, 0.5) == [3, 0, 4]
    # cumulative: [.9 .72 .684 .205], [.4 ...], [.9 .81 .729 .656]
    assert static_threshold_lengths(confidence_RK, 0.7, cumulative=True) == [2, 0, 3]
    assert static_threshold_lengths(confidence_RK, 0.0) == [4, 4, 4]
    assert static_threshold_lengths(confidence_RK, 0.0, max_lengths_R=[1, 2, 3]) == [1, 2, 3]
    with pytest.raises(ValueError, match="threshold must be a number in"):
        static_threshold_lengths(confidence_RK, 1.5)


def test_fixed_lengths_and_policy_dispatch(tmp_path):
    confidence_RK = [[0.9, 0.8], [0.2, 0.9]]
    assert fixed_lengths(2, 5) == [5, 5]
    assert VerificationPolicy("fixed").lengths(confidence_RK) == [2, 2]
    assert VerificationPolicy("threshold", threshold=0.5).lengths(confidence_RK) == [2, 0]
    table = SPSTable([2, 3, 4], [10.0, 9.0, 5.0])
    table.save(tmp_path / "sps.json")
    policy = VerificationPolicy("scheduler", sps_table_path=str(tmp_path / "sps.json"))
    # 2*10 = 20 -> 2.9*9 = 26.1 -> 3.62*5 (B=4) = 18.1 stop.
    assert policy.lengths(confidence_RK) == [1, 0]
    assert VerificationPolicy("scheduler").lengths(confidence_RK, sps=lambda b: 1.0) == [2, 2]
    with pytest.raises(ValueError, match="needs sps=... or sps_table_path"):
        VerificationPolicy("scheduler").lengths(confidence_RK)
    with pytest.raises(ValueError, match="mode must be one of"):
        VerificationPolicy("greedy")


def test_sps_interpolation_and_conservative_extrapolation():
    table = SPSTable([2, 4, 8], [100.0, 80.0, 40.0])
    assert table.sps(3) == pytest.approx(90.0)
    assert table(6) == pytest.approx(60.0)
    assert table.sps(1) == 100.0  # below range: no speed-up assumed
    assert table.sps(16) == pytest.approx(20.0)  # above range: step time proportional to B
    with pytest.raises(ValueError, match="strictly increasing"):
        SPSTable([4, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="finite and > 0"):
        SPSTable([1], [0.0])


def test_profile_sps_times_each_batch_size():
    calls = []
    fake_now = [0.0]

    def clock():
        return fake_now[0]

    def forward_fn(batch_size):
        calls.append(batch_size)
        fake_now[0] += 0.01 * batch_size  # a step over B tokens takes B * 10 ms

    table = profile_sps(forward_fn, [4, 1, 2], warmup=1, repeats=3, fingerprint={"x": 1}, clock=clock)
    assert table.batch_sizes == [1, 2, 4]
    assert table.steps_per_second == pytest.approx([100.0, 50.0, 25.0])
    assert calls == [1] * 4 + [2] * 4 + [4] * 4
    assert table.fingerprint == {"x": 1}


def test_save_load_and_fingerprint_mismatch_reprofiles(tmp_path):
    path = tmp_path / "sps.json"
    calls = []

    def forward_fn(batch_size):
        calls.append(batch_size)
        time.sleep(1e-4)  # a measurable step

    fingerprint = {"target_id": "smollm2", "dtype": "float32", "device_name": "cpu-a"}
    first = load_or_profile(path, fingerprint, forward_fn, [1, 2], warmup=0, repeats=1)
    assert calls == [1, 2] and path.exists()
    again = load_or_profile(path, dict(fingerprint), forward_fn, [2, 1], warmup=0, repeats=1)
    assert calls == [1, 2] and again == first  # reused, no new profiling
    other = {**fingerprint, "device_name": "cpu-b"}
    redone = load_or_profile(path, other, forward_fn, [1, 2], warmup=0, repeats=1)
    assert calls == [1, 2, 1, 2] and redone.fingerprint == other
    assert SPSTable.load(path).fingerprint == other
    load_or_profile(path, other, forward_fn, [1, 2, 4], warmup=0, repeats=1)  # new batch sizes
    assert calls[4:] == [1, 2, 4]


def test_load_rejects_malformed_tables(tmp_path):
    path = tmp_path / "sps.json"
    path.write_text(json.dumps({"format_version": 1, "batch_sizes": [1, 2], "steps_per_second": [1.0]}))
    with pytest.raises(ValueError, match="missing field 'fingerprint'"):
        SPSTable.load(path)
    table = {"format_version": 1, "batch_sizes": [1, 2], "steps_per_second": [1.0], "fingerprint": {}}
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=r"sps.json: SPSTable: 2 batch_sizes but 1 steps_per_second"):
        SPSTable.load(path)
    with pytest.raises(FileNotFoundError):
        SPSTable.load(tmp_path / "missing.json")


def test_environment_fingerprint_is_json_and_reused(tmp_path):
    from deepspec.decoding.scheduler import environment_fingerprint

    fingerprint = environment_fingerprint("smollm2-135m", "float32", "cpu")
    assert fingerprint["torch_version"] == torch.__version__ and fingerprint["cpu_model"]
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    calls = []

    def forward_fn(batch_size):
        calls.append(batch_size)
        time.sleep(1e-4)

    tuple_fingerprint = {**fingerprint, "layers": (1, 2)}  # a tuple survives the JSON round trip as a list
    load_or_profile(tmp_path / "sps.json", tuple_fingerprint, forward_fn, [1], warmup=0, repeats=1)
    load_or_profile(tmp_path / "sps.json", tuple_fingerprint, forward_fn, [1], warmup=0, repeats=1)
    assert calls == [1]
