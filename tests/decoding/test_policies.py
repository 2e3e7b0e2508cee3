"""Length policies of the batch-1 loop truncate as specified."""

import pytest
import torch

from deepspec.decoding.policies import fixed_policy, threshold_policy


def test_length_policies():
    conf = torch.tensor([0.9, 0.8, 0.3, 0.95])
    assert fixed_policy()(None, 4) == 4
    assert fixed_policy(verify_length=2)(conf, 4) == 2
    assert threshold_policy(0.5)(conf, 4) == 2
    assert threshold_policy(0.0)(conf, 4) == 4
    assert threshold_policy(0.5, cumulative=True)(conf, 4) == 2  # 0.9, 0.72, 0.216
    assert threshold_policy(0.75, cumulative=True)(conf, 4) == 1
    assert threshold_policy(0.5)(conf, 1) == 1
    with pytest.raises(ValueError, match="confidence head"):
        threshold_policy(0.5)(None, 4)
    with pytest.raises(ValueError, match="threshold"):
        threshold_policy(1.5)
    with pytest.raises(ValueError, match="verify_length"):
        fixed_policy(verify_length=-1)
