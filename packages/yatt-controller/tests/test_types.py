"""Validation of yatt_controller's spec: consistent modes and health timings."""

import pytest
from yatt_controller.types import ControllerSpec


def test_bad_specs():
    with pytest.raises(ValueError, match="must be 1 in single mode"):
        ControllerSpec(mode="single", num_controllers=2)
    with pytest.raises(ValueError, match="0 < heartbeat_interval_s < hang_timeout_s"):
        ControllerSpec(heartbeat_interval_s=10.0, hang_timeout_s=5.0)
    with pytest.raises(ValueError, match="num_controllers must be >= 1, got 0"):
        ControllerSpec(num_controllers=0)
    assert ControllerSpec(num_controllers=4).mode == "parallel"
