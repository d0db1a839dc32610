"""Wire and config types of yatt-placement: what a cluster and its roles look like, and where roles go.

Configs (`ClusterSpec`, `RoleSpec`) are frozen and reject unknown fields. Wire types (`PlacementPlan`,
`PhaseStats`, ...) tolerate unknown fields so that newer producers can talk to older consumers. Fields are only
ever appended, with defaults.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Role = Literal["actor", "rollout", "reference", "critic", "reward", "genrm"]
PlacementMode = Literal["colocated", "partial", "disaggregated", "dynamic"]


class _Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of typed configuration: immutable, unknown fields are an error. (kw_only is not inherited:
    every subclass states it.)"""


class _Wire(msgspec.Struct, omit_defaults=True):
    """Base of messages: unknown fields are ignored, defaults are not sent."""


class ClusterSpec(_Config, frozen=True, kw_only=True):
    """The devices a job may use.

    Producer: the user's config (apps) or an embedding framework. Consumer: `yatt_placement.plan`,
    the simulator and `realize`.
    """

    num_nodes: int
    devices_per_node: int
    device_memory_gb: float = 80.0
    device_kind: str = "gpu"

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"ClusterSpec.num_nodes must be >= 1, got {self.num_nodes}")
        if self.devices_per_node < 1:
            raise ValueError(f"ClusterSpec.devices_per_node must be >= 1, got {self.devices_per_node}")
        if self.device_memory_gb <= 0:
            raise ValueError(f"ClusterSpec.device_memory_gb must be > 0, got {self.device_memory_gb}")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


class RoleSpec(_Config, frozen=True, kw_only=True):
    """One role of the RL job and the model it runs.

    Producer: the user's config (apps). Consumer: the planner, which sizes replicas from it, and the
    controller, which launches `num_replicas` worker groups of `tensor_parallel * pipeline_parallel` devices.
    `num_replicas = 0` lets the planner choose.
    """

    role: Role
    num_params: float
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    num_replicas: int = 0
    trainable: bool = False
    memory_gb: float | None = None  # per device; None: estimated by the planner from num_params
    name: str = ""  # distinguishes several roles of one kind, e.g. two GenRM judges
    # the key of a role whose devices this one shares instead of taking its own: a rule reward has no model,
    # so in disaggregated mode it runs beside the rollout engines rather than idling a device ("": own slice)
    shares: str = ""

    def __post_init__(self) -> None:
        if self.num_params <= 0:
            raise ValueError(f"RoleSpec({self.role}).num_params must be > 0, got {self.num_params}")
        for field in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, field) < 1:
                raise ValueError(f"RoleSpec({self.role}).{field} must be >= 1, got {getattr(self, field)}")
        if self.num_replicas < 0:
            raise ValueError(f"RoleSpec({self.role}).num_replicas must be >= 0, got {self.num_replicas}")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


class RolePlacement(_Wire, kw_only=True):
    """Where one role runs: a list of replicas, each a list of global device indices.

    Producer: the planner. Consumer: `realize` (bundle indices) and the controller (worker groups).
    """

    role: Role
    replicas: list[list[int]]
    name: str = ""
    colocated_with: list[str] = []  # roles that time-share these devices


class PlacementPlan(_Wire, kw_only=True):
    """A complete placement: every role's devices under one mode.

    Producer: `plan` and the dynamic re-planner (which bumps `version` and sets `reason`).
    Consumer: `realize`, the controller, the `yatt plan` command.
    """

    mode: PlacementMode
    num_devices: int
    roles: list[RolePlacement]
    version: int = 0
    reason: str = ""

    # ---- facts a job reads instead of comparing mode strings -------------------------------------------
    # A role is named by its key: `RolePlacement.name`, or its role when unnamed (as `planner.role_key`).
    # A role the plan does not hold has no devices and no replicas.

    def role_keys(self) -> list[str]:
        """The plan's role keys, in plan order."""
        return [placement.name or placement.role for placement in self.roles]

    def placement(self, key: str) -> RolePlacement | None:
        """The placement of role `key`, or None when the plan has no such role."""
        return next((p for p in self.roles if (p.name or p.role) == key), None)

    def devices(self, key: str) -> list[int]:
        """The global device ids role `key` runs on (every replica's), sorted; [] for an absent role."""
        placement = self.placement(key)
        return sorted({d for replica in placement.replicas for d in replica}) if placement else []

    def num_replicas(self, key: str) -> int:
        """How many replicas (model-parallel groups) role `key` has; 0 for an absent role."""
        placement = self.placement(key)
        return len(placement.replicas) if placement else 0

    def shares_device(self, key_a: str, key_b: str) -> bool:
        """Whether roles `key_a` and `key_b` hold at least one device in common (so their memory is shared
        and their processes may be the same one). False when either role is absent."""
        return bool(set(self.devices(key_a)) & set(self.devices(key_b)))

    @property
    def sleeps(self) -> bool:
        """Roles time-share every device phase by phase (full colocation): each engine releases its memory
        (sleep / offload) before the learner runs and wakes before it generates again."""
        return self.mode == "colocated"

    @property
    def streams_into_judge(self) -> bool:
        """Rollout and a generative judge (a `genrm` role) run concurrently on disjoint devices, so finished
        samples stream from one into the other while generation continues (partial colocation, dynamic,
        disaggregated). False without a judge or where they share a device (full colocation)."""
        judges = [p.name or p.role for p in self.roles if p.role == "genrm"]
        rollout = self.placement("rollout")
        return bool(judges and rollout) and not any(self.shares_device("rollout", key) for key in judges)

    @property
    def movable(self) -> bool:
        """The devices of the split roles may move between steps (dynamic: the re-planner re-partitions at a
        weight-sync boundary); a static plan keeps every role where it is for the whole run."""
        return self.mode == "dynamic"


class PhaseStats(_Wire, kw_only=True):
    """Measured busy time of each role over one RL step.

    Producer: the controllers (per-phase timers). Consumer: the dynamic re-planner and the run's metrics.
    """

    step: int
    step_time_s: float
    busy_s: dict[str, float]  # role name -> seconds the role's devices were busy this step
    num_devices: dict[str, int] = {}  # role name -> devices held this step


class JobProfile(_Config, frozen=True, kw_only=True):
    """Measured cost of one RL step, per role: the device-seconds of work it did (busy seconds x devices held).

    Producer: a profiling run (`JobProfile.from_stats` over `PhaseStats`) or the simulator. Consumer: `plan`,
    which sizes the rollout/GenRM split and disaggregated slices so each role's work per device is level.
    Keys are role names (`RoleSpec.name`, or the role when unnamed).
    """

    device_seconds: dict[str, float]
    num_steps: int = 1  # how many measured steps the figures average over

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"JobProfile.num_steps must be >= 1, got {self.num_steps}")
        for key, value in self.device_seconds.items():
            if not value >= 0:  # also rejects NaN
                raise ValueError(f"JobProfile.device_seconds[{key!r}] must be >= 0, got {value}")

    @classmethod
    def from_stats(cls, stats: list[PhaseStats]) -> JobProfile:
        """Average busy x devices over measured steps; a role missing from `num_devices` counts 1 device."""
        if not stats:
            raise ValueError("JobProfile.from_stats needs at least one PhaseStats")
        totals: dict[str, float] = {}
        for step in stats:
            for key, busy in step.busy_s.items():
                totals[key] = totals.get(key, 0.0) + busy * step.num_devices.get(key, 1)
        averages = {key: total / len(stats) for key, total in totals.items()}
        return cls(device_seconds=averages, num_steps=len(stats))


class ReplanConfig(_Config, frozen=True, kw_only=True):
    """Knobs of the dynamic re-planner (`yatt_placement.replanner`): when a measured imbalance is acted on.

    Producer: the user's config (apps). Consumer: `DynamicReplanner`.
    """

    gap_threshold: float = 0.1  # 1 - idlest / busiest role busy time that counts as imbalance
    patience: int = 2  # consecutive imbalanced steps, same donor and receiver, before a move
    min_gain: float = 0.05  # a move must cut the predicted slowest role's time by at least this fraction
    ema_decay: float = 0.3  # smoothing of the measured busy times (0: no smoothing)
    cooldown: int = 1  # steps ignored after a move (they may still run under the previous plan)
    # steps ignored at the start: their calls pay one-time costs (engine compile, allocator warm-up, the
    # first batch's padding caches), many times a steady step's busy time on small models
    warmup_steps: int = 1
    # steps after a move's cooldown whose median step time, when more than verify_tolerance above the step time
    # before the move, undoes it (and it is not tried again from that layout); 0: moves are not verified. For
    # workloads whose step time holds still over a few steps: one that drifts faster (lengths growing several %
    # per step) would blame a move for the drift
    verify_steps: int = 0
    verify_tolerance: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.gap_threshold < 1:
            raise ValueError(f"ReplanConfig.gap_threshold must be in (0, 1), got {self.gap_threshold}")
        if self.patience < 1:
            raise ValueError(f"ReplanConfig.patience must be >= 1, got {self.patience}")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"ReplanConfig.min_gain must be in [0, 1), got {self.min_gain}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ReplanConfig.ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.cooldown < 0:
            raise ValueError(f"ReplanConfig.cooldown must be >= 0, got {self.cooldown}")
        if self.warmup_steps < 0:
            raise ValueError(f"ReplanConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.verify_steps < 0:
            raise ValueError(f"ReplanConfig.verify_steps must be >= 0, got {self.verify_steps}")
        if not self.verify_tolerance >= 0:
            raise ValueError(f"ReplanConfig.verify_tolerance must be >= 0, got {self.verify_tolerance}")
