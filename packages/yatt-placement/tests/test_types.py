"""Validation of yatt_placement's configs: bad values name the field, on construction and on decode."""

import msgspec
import pytest
from yatt_placement.types import ClusterSpec, RoleSpec


def test_cluster_and_role_derived_sizes():
    assert ClusterSpec(num_nodes=8, devices_per_node=8).num_devices == 64
    assert (
        RoleSpec(role="genrm", num_params=72e9, tensor_parallel=4, pipeline_parallel=2).model_parallel_size
        == 8
    )


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="devices_per_node must be >= 1, got 0"):
        ClusterSpec(num_nodes=1, devices_per_node=0)
    with pytest.raises(ValueError, match=r"RoleSpec\(rollout\).tensor_parallel must be >= 1"):
        RoleSpec(role="rollout", num_params=1e9, tensor_parallel=0)
    with pytest.raises(msgspec.ValidationError, match="num_nodes must be >= 1"):
        msgspec.json.decode(b'{"num_nodes": 0, "devices_per_node": 8}', type=ClusterSpec)
    with pytest.raises(msgspec.ValidationError, match=r"Invalid enum value .teacher. - at `\$\.role`"):
        msgspec.json.decode(b'{"role": "teacher", "num_params": 1}', type=RoleSpec)
