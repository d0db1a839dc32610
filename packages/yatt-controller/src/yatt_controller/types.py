"""Wire and config types of yatt-controller: how controllers run, what they report, checkpoints.

The controller is generic: nothing here knows losses, rewards or engines. `ControllerSpec` is a frozen
config that rejects unknown fields; reports, heartbeats and manifests are messages that tolerate them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

ControllerMode = Literal["parallel", "single"]
OnFailure = Literal["restart", "fail"]


class _Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of typed configuration: immutable, unknown fields are an error. (kw_only is not inherited:
    every subclass states it.)"""


class _Wire(msgspec.Struct, omit_defaults=True):
    """Base of messages: unknown fields are ignored, defaults are not sent."""


class ControllerSpec(_Config, kw_only=True, frozen=True):
    """How the driver runs the job's controllers.

    Producer: the app's config. Consumer: the driver, which launches `num_controllers` controllers
    (one per data-parallel group of the trainer) in "parallel" mode, or one driver-side controller in "single".
    """

    mode: ControllerMode = "parallel"
    num_controllers: int = 1
    seed: int = 0
    heartbeat_interval_s: float = 5.0
    hang_timeout_s: float = 600.0
    on_failure: OnFailure = "restart"
    max_restarts: int = 3
    checkpoint_every: int = 0  # steps; 0 disables
    keep_checkpoints: int = 2
    max_inflight: int = 8  # bound on outstanding calls per worker group
    # count every payload byte the driver sends or receives through Ray (wraps Ray's API for the run's
    # duration); off by default: `RunResult.driver_bytes` is then None, never a 0 that was not counted
    count_driver_bytes: bool = False
    # workers with the sharded checkpoint protocol (a torch learner) stage their state in host memory and write
    # it while the next step runs; the checkpoint commits (manifest last) once written, and the run waits for
    # the last write before it ends. Workers without it (bytes state) always save synchronously.
    checkpoint_async: bool = True
    # parallel mode: each controller lives in the host process of its learner rank's device (no process of
    # its own); False gives each a process of its own (`ControllerActor`), as before yatt-controller 0.8.0
    hosted: bool = True

    def __post_init__(self) -> None:
        if self.num_controllers < 1:
            raise ValueError(f"ControllerSpec.num_controllers must be >= 1, got {self.num_controllers}")
        if self.mode == "single" and self.num_controllers != 1:
            raise ValueError("ControllerSpec.num_controllers must be 1 in single mode")
        if self.heartbeat_interval_s <= 0 or self.hang_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("ControllerSpec needs 0 < heartbeat_interval_s < hang_timeout_s")
        if self.max_restarts < 0 or self.keep_checkpoints < 1 or self.max_inflight < 1:
            raise ValueError("ControllerSpec.max_restarts >= 0, keep_checkpoints >= 1, max_inflight >= 1")


class StepReport(_Wire, kw_only=True):
    """What one controller reports for one step: metrics, per-phase timings, sample counts.

    Producer: a controller's step function. Consumer: the driver (logging, health) and the re-planner (timings).
    Only these small numbers reach the driver in parallel mode; `driver_bytes` counts any sample bytes that did.
    """

    step: int
    controller_rank: int
    metrics: dict[str, float] = {}
    timings_s: dict[str, float] = {}
    num_samples: int = 0
    driver_bytes: int = 0


class Heartbeat(_Wire, kw_only=True):
    """A liveness beat. Producer: every hosted actor. Consumer: the driver's health monitor, and its
    re-planning hook (`busy_s`: a host's cumulative seconds in calls, per hosted role key)."""

    actor: str
    node_id: str
    step: int
    phase: str
    time_unix: float
    busy_s: dict[str, float] = {}


class CheckpointManifest(_Wire, kw_only=True):
    """The last file written into a checkpoint directory: its presence marks the checkpoint complete.

    Producer: the checkpoint writer. Consumer: resume, which takes the newest directory with a valid manifest
    and checks each file's size and sha256.
    """

    step: int
    created_unix: float
    files: dict[str, str]  # relative path -> sha256 hex
    sizes: dict[str, int] = {}
    policy_version: int = 0
    format_version: int = 1


class WorkerInfo(_Wire, kw_only=True):
    """Where one hosted worker sits: handed to a hosted class that asks for it (`pass_worker_info=True`).

    Producer: `WorkerGroup`. Consumer: the hosted class (e.g. a learner joining its data-parallel group).
    """

    role: str
    dp_rank: int
    dp_size: int
    tp_rank: int = 0
    tp_size: int = 1
    device: int = 0
    name: str = ""


class BucketLayout(_Wire, kw_only=True):
    """One bucket of a weight sync: tensors of one dtype packed back to back into one flat buffer.

    Producer: the trainer rank that sends (`weight_sync.plan_buckets`). Consumer: every receiving engine
    worker, which allocates `nbytes`, receives the buffer and cuts it into `names` with `shapes`.
    """

    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    names: list[str]
    shapes: list[list[int]]
    nbytes: int
