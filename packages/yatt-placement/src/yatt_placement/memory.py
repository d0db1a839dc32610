"""Per-device memory estimate of a role, and the check that a plan fits the devices.

The estimate for a trained model is the one the WeChat-YATT authors use (PAPERS.md, "Placement"):

    params x [(2 + 6 + O) / model_parallel + 12 / num_devices] bytes  (+ activations)

bf16 weights (2), bf16 + fp32 gradients (6) and O bytes of other buffers (O about 0.5-2) are split by model
parallelism; the fp32 master weights and the two Adam moments (12) are sharded over every device the trainer
spans by a distributed optimizer. An inference role (rollout, reference, reward, GenRM) holds bf16 weights split
by model parallelism, plus the same activation/KV-cache reserve. Colocated roles swap (sleep/offload) between
phases, so a device must fit its largest role, not their sum: the check is per role.
"""

from __future__ import annotations

from yatt_placement.types import ClusterSpec, PlacementPlan, RoleSpec

GB = 1e9
WEIGHT_BYTES = 2.0  # bf16
GRADIENT_BYTES = 6.0  # bf16 gradient + fp32 main gradient
OPTIMIZER_BYTES = 12.0  # fp32 master weights + Adam m and v, sharded over data parallel


def estimate_memory_gb(
    spec: RoleSpec, num_devices: int, *, optimizer_overhead: float = 1.0, activation_gb: float = 4.0
) -> float:
    """GB per device for `spec` spread over `num_devices` devices. `spec.memory_gb`, when set, wins.

    `optimizer_overhead` is O of the formula (bytes per parameter of other training buffers);
    `activation_gb` is the reserve for activations (training) or the KV cache (inference).
    """
    if spec.memory_gb is not None:
        return spec.memory_gb
    if num_devices < spec.model_parallel_size:
        raise ValueError(
            f"role {_label(spec)} spans {num_devices} devices, fewer than its model-parallel size "
            f"{spec.model_parallel_size}"
        )
    mp = spec.model_parallel_size
    if spec.trainable:
        per_param = (WEIGHT_BYTES + GRADIENT_BYTES + optimizer_overhead) / mp + OPTIMIZER_BYTES / num_devices
    else:
        per_param = WEIGHT_BYTES / mp
    return spec.num_params * per_param / GB + activation_gb


def check_memory(
    plan: PlacementPlan,
    cluster: ClusterSpec,
    roles: list[RoleSpec],
    *,
    optimizer_overhead: float = 1.0,
    activation_gb: float = 4.0,
) -> dict[str, float]:
    """Raise ValueError naming the first role that does not fit and by how much; else return GB per role."""
    specs = {_key(spec): spec for spec in roles}
    needs: dict[str, float] = {}
    for placement in plan.roles:
        spec = specs[placement.name or placement.role]
        num_devices = sum(len(replica) for replica in placement.replicas)
        need = estimate_memory_gb(
            spec, num_devices, optimizer_overhead=optimizer_overhead, activation_gb=activation_gb
        )
        if need > cluster.device_memory_gb:
            raise ValueError(
                f"role {_label(spec)} needs {need:.1f} GB per device over {num_devices} devices "
                f"(model_parallel {spec.model_parallel_size}) but a device has {cluster.device_memory_gb:.1f} GB: "
                f"short by {need - cluster.device_memory_gb:.1f} GB; raise tensor_parallel or "
                "pipeline_parallel, or use devices with more memory"
            )
        needs[_key(spec)] = need
    return needs


def _key(spec: RoleSpec) -> str:
    return spec.name or spec.role


def _label(spec: RoleSpec) -> str:
    return f"{spec.role!r}" if not spec.name else f"{spec.name!r} ({spec.role})"
