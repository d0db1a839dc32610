"""Pure parts of the runtime, without Ray actors: dispatch splits and routing, byte accounting, reductions,
the sampler, atomic checkpoints (a real crash mid-write), version checks."""

from __future__ import annotations

import multiprocessing
import os
import re

import msgspec
import pytest
from yatt_controller import checkpoint
from yatt_controller.collective import Collective, reduce_dicts
from yatt_controller.data import ShardSampler
from yatt_controller.dispatch import route, shard_rows, split_evenly, split_rows
from yatt_controller.ledger import SCALAR_BYTES, ByteLedger, payload_nbytes
from yatt_controller.reports import ReportLog
from yatt_controller.sync import StaleSampleError, check_versions
from yatt_controller.types import StepReport


def test_split_evenly_and_route():
    assert split_evenly([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert split_evenly([1, 2], 3) == [[1], [2], []]
    assert split_evenly(list(range(8)), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="num_chunks must be >= 1, got 0"):
        split_evenly([1], 0)
    assert route(4, 2, 1) == [2, 3]
    assert route(1, 2, 1) == [0]
    assert route(2, 4, 3) == [1]  # fewer replicas than controllers: round robin
    with pytest.raises(ValueError, match="3 replicas cannot be split evenly over 2 controllers"):
        route(3, 2, 0)
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\), got 2"):
        route(2, 2, 2)
    # after a live move: blocks may differ by one, the larger first
    assert [route(3, 2, r, uneven=True) for r in (0, 1)] == [[0, 1], [2]]
    assert [route(5, 2, r, uneven=True) for r in (0, 1)] == [[0, 1, 2], [3, 4]]


def test_a_replan_may_move_services_only():
    from yatt_controller.replace import changed_roles
    from yatt_placement.types import PlacementPlan, RolePlacement

    def plan(rollout, judge, actor=([0], [1])):
        roles = [
            RolePlacement(role="actor", replicas=list(actor)),
            RolePlacement(role="rollout", replicas=rollout),
            RolePlacement(role="reward", replicas=judge, name="judge"),
        ]
        return PlacementPlan(mode="partial", num_devices=4, roles=roles)

    from yatt_controller.roster import Roster

    class _Group:  # a stand-in for a WorkerGroup: only role and name are read
        def __init__(self, role: str, name: str = "") -> None:
            self.role, self.name = role, name

    groups = {"actor": _Group("actor"), "rollout": _Group("rollout"), "judge": _Group("reward", "judge")}
    start, frozen = plan([[0], [1]], [[2], [3]]), Roster(groups, learner="actor")  # type: ignore[arg-type]
    assert changed_roles(start, plan([[0], [1], [2]], [[3]]), frozen) == [
        ("rollout", ""),
        ("reward", "judge"),
    ]
    assert changed_roles(start, start, frozen) == []
    with pytest.raises(ValueError, match="replan: role 'actor' cannot move: it is the learner"):
        changed_roles(start, plan([[0], [1]], [[2], [3]], actor=([0], [1], [2])), frozen)
    with pytest.raises(ValueError, match=r"replan: devices \[4\] are outside the running plan's 4 devices"):
        changed_roles(start, plan([[0], [1], [4]], [[2], [3]]), frozen)
    with pytest.raises(
        ValueError, match=r"replan: the new plan has roles \[\('actor', ''\), \('rollout', ''\)\]"
    ):
        changed_roles(start, PlacementPlan(mode="partial", num_devices=4, roles=start.roles[:2]), frozen)


class _RecordingWorker:
    """A worker double: records what it was sent and returns a token naming itself instead of a ref."""

    def __init__(self, dp_rank: int, tp_rank: int) -> None:
        self.dp_rank, self.tp_rank, self.got = dp_rank, tp_rank, []

    def submit(self, method: str, args: tuple, kwargs: dict) -> str:
        self.got.append((method, args, kwargs))
        return f"ref-{self.dp_rank}.{self.tp_rank}"


def test_shard_rows_sends_each_rank_its_rows_and_its_tp_peers_the_same():
    import numpy as np

    workers = [_RecordingWorker(d, t) for d in range(3) for t in range(2)]  # 3 dp ranks x tp 2
    batch = {"ids": list(range(7)), "x": np.arange(14).reshape(7, 2), "lr": 0.1, "mask": None, "pair": (1, 2)}
    refs = shard_rows(workers, "train", batch, tag="t")
    assert refs == ["ref-0.0", "ref-1.0", "ref-2.0"]  # one per dp rank, the tp_rank-0 worker's, in order
    sizes = {(w.dp_rank, w.tp_rank): w.got[0][1][0]["ids"] for w in workers}
    assert sizes == {
        (0, 0): [0, 1, 2],
        (0, 1): [0, 1, 2],
        (1, 0): [3, 4],
        (1, 1): [3, 4],
        (2, 0): [5, 6],
        (2, 1): [5, 6],
    }
    chunk = workers[2].got[0][1][0]  # dp rank 1
    assert chunk["x"].tolist() == [[6, 7], [8, 9]] and chunk["lr"] == 0.1 and chunk["mask"] is None
    assert chunk["pair"] == (1, 2) and workers[2].got[0][2] == {"tag": "t"}  # (1, 2) is not 7 rows long
    assert [c["ids"] for c in split_rows({"ids": [1, 2]}, 1)] == [[1, 2]]
    with pytest.raises(
        ValueError, match="shard_rows: batch has 2 rows, fewer than the 3 data-parallel ranks"
    ):
        shard_rows(workers, "train", {"ids": [0, 1]})
    with pytest.raises(ValueError, match=r"shard_rows: batch has no row-sliceable value \(keys \['lr'\]\)"):
        split_rows({"lr": 0.1}, 2)


def test_stream_busy_and_overlap_are_unions_of_intervals():
    from yatt_controller.stream import StreamResult

    out = StreamResult(values=[], intervals={"a": [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], "b": [(2.5, 5.5)]})
    assert out.busy_s("a") == 4.0  # [0, 3] and [5, 6]
    assert out.busy_s("b") == 3.0
    assert out.overlap_s("a", "b") == out.overlap_s("b", "a") == 1.0  # [2.5, 3] and [5, 5.5]


def test_busy_readings_carry_a_poll_burst_and_drop_held_windows():
    from yatt_controller.replan import BusyReadings

    readings = BusyReadings(started=0.0)
    # step 0, read at t=30: all busy seconds since the start (a window that spans the services' start-up)
    assert readings.read({"judge": 3.0, "rollout": 1.0}, 30.0) == {"judge": 3.0, "rollout": 1.0}
    # step 1 at t=31: a 1 s window, used (the start-up window is no measure of a step)
    assert readings.read({"judge": 3.5, "rollout": 1.25}, 31.0) == {"judge": 0.5, "rollout": 0.25}
    # step 2's report came in the same poll, read 0.01 s later: under a quarter of 1 s, carried
    assert readings.read({"judge": 3.6, "rollout": 1.25}, 31.01) == {}
    # step 3 at t=32: the carried seconds are in this window (0.6 s of judge since t=31)
    assert readings.read({"judge": 4.1, "rollout": 1.5}, 32.0) == pytest.approx(
        {"judge": 0.6, "rollout": 0.25}
    )
    # a move landing: the window is dropped, the next one starts where it ended
    assert readings.read({"judge": 9.0, "rollout": 2.0}, 33.0, usable=False) == {}
    assert readings.read({"judge": 9.5, "rollout": 2.5, "new": 0.1}, 34.0) == {
        "judge": 0.5,
        "new": 0.1,
        "rollout": 0.5,
    }


def test_a_host_ping_reads_its_calls_while_they_change(monkeypatch):
    """The health thread reads a host's calls while its call threads add and remove them: `longest_call`
    iterates a copy. The stand-in call below adds a call the moment it is read, as a call thread can between
    two items; reading the dict itself raises "dictionary changed size during iteration"."""
    from yatt_controller.worker_group import longest_call

    busy: dict[str, tuple[str, float]] = {}

    class Call(tuple):
        def __getitem__(self, i):
            busy[f"started-{len(busy)}"] = ("learner.train", 30.0)
            return tuple.__getitem__(self, i)

    busy["engine"] = Call(("engine.generate", 20.0))
    busy["reward"] = ("reward.score", 10.0)
    assert longest_call(busy) == ("reward.score", 10.0)
    assert len(busy) > 2  # the stand-in did change the dict while it was read
    with pytest.raises(RuntimeError, match="changed size during iteration"):  # what ping used to do
        min(busy.values(), key=lambda call: call[1])
    monkeypatch.setattr("yatt_controller.worker_group.time.time", lambda: 1234.5)
    assert longest_call({}) == ("", 1234.5)  # no call: nothing busy, as of the host's clock


def test_payload_nbytes_counts_payload_not_structure():
    np = pytest.importorskip("numpy")
    # 1000 bytes + 3 ("abc") + 8 * 4 (float32 [2, 4]) + one scalar
    assert (
        payload_nbytes([b"x" * 1000, "abc", np.zeros((2, 4), np.float32), 7]) == 1000 + 3 + 32 + SCALAR_BYTES
    )
    # a dict counts keys and values; a Struct its fields: step, rank (scalars), 4 dicts/ints
    assert payload_nbytes({"ab": b"1234"}) == 2 + 4
    report = StepReport(step=1, controller_rank=0)
    assert payload_nbytes(report) == 2 * SCALAR_BYTES + 0 + 0 + 2 * SCALAR_BYTES
    assert payload_nbytes(memoryview(bytearray(100))[:10]) == 10
    ledger = ByteLedger()
    ledger.count_sent(b"x" * 50)
    assert ledger.total == 0  # inactive: a controller's ledger never counts
    ledger.active = True
    ledger.count_sent(b"x" * 50)
    ledger.count_received([b"y" * 20])
    assert (ledger.sent, ledger.received, ledger.total) == (50, 20, 70)


def test_report_log_logs_every_step_once_across_a_restart():
    """A step re-run after a restart (its checkpoint was not complete) completes on this attempt's reports
    only and is not logged again; its new reports are what the run returns. A step replayed from a
    checkpoint is logged unless it was."""
    logged: list[tuple[int, list[float]]] = []
    log = ReportLog(2, lambda step, reports: logged.append((step, [r.metrics["x"] for r in reports])))

    def report(step: int, rank: int, x: float) -> StepReport:
        return StepReport(step=step, controller_rank=rank, metrics={"x": x})

    assert [log.take(report(0, r, 1.0)) for r in (1, 0)] == [False, True]
    assert [log.take(report(1, r, 2.0)) for r in (0, 1)] == [False, True]
    assert log.logged_through == 1
    log.new_attempt()  # resumed from step 0's checkpoint: step 1 runs again
    log.replay(0, {0: report(0, 0, 9.0), 1: report(0, 1, 9.0)})
    log.replay(2, {0: report(2, 0, 9.0)})  # incomplete: not logged
    assert log.take(report(1, 0, 3.0)) is False  # attempt 1's rank-1 report does not complete it
    assert log.take(report(1, 1, 3.0)) is True
    assert log.take(report(2, 1, 4.0)) is False and log.take(report(2, 0, 4.0)) is True
    assert logged == [(0, [1.0, 1.0]), (1, [2.0, 2.0]), (2, [4.0, 4.0])]
    assert {step: [r.metrics["x"] for r in rs] for step, rs in log.ordered().items()} == {
        0: [1.0, 1.0],
        1: [3.0, 3.0],
        2: [4.0, 4.0],
    }


def test_reduce_and_local_collective():
    assert reduce_dicts([{"n": 2, "r": 1.0}, {"n": 3, "r": 0.0}], "sum") == {"n": 5.0, "r": 1.0}
    assert reduce_dicts([{"n": 2}, {"n": 3}], "mean") == {"n": 2.5}
    assert reduce_dicts([{"n": 2}, {"n": 3}], "max") == {"n": 3.0}
    with pytest.raises(ValueError, match="rank 1 has keys \\['m'\\], rank 0 has \\['n'\\]"):
        reduce_dicts([{"n": 2}, {"m": 3}], "sum")
    with pytest.raises(ValueError, match="unknown reduce op 'median'"):
        reduce_dicts([{"n": 2}], "median")
    single = Collective(None, 0, 1)
    assert single.all_reduce({"n": 4}) == {"n": 4.0}
    assert single.all_gather("x") == ["x"]


def test_sampler_shards_partition_the_global_batch_and_resume():
    # two controllers' parts, in rank order, are exactly the single controller's batch, epoch after epoch
    whole = ShardSampler(10, 4, seed=3)
    parts = [ShardSampler(10, 4, seed=3, num_shards=2, shards=[r]) for r in range(2)]
    seen = []
    for _ in range(5):  # 2 steps per epoch (10 // 4): crosses two epoch boundaries
        batch = whole.next()
        assert batch == parts[0].next() + parts[1].next()
        assert len(batch) == 4 and len(set(batch)) == 4
        seen.append(batch)
    assert whole.state() == {"epoch": 2, "step_in_epoch": 1}
    assert set(seen[0] + seen[1]) < set(range(10))  # drop-last: 8 of 10 rows per epoch
    assert seen[0] != seen[2]  # a new permutation each epoch
    resumed = ShardSampler(10, 4, seed=3)
    resumed.load_state({"epoch": 1, "step_in_epoch": 0})
    assert [resumed.next() for _ in range(3)] == seen[2:]
    with pytest.raises(ValueError, match="batch_size 5 must divide evenly over 2 controllers"):
        ShardSampler(10, 5, seed=0, num_shards=2, shards=[0])
    with pytest.raises(ValueError, match="the dataset has 3 rows, fewer than one batch of 4"):
        ShardSampler(3, 4, seed=0)


def test_step_draws_extra_rows_from_its_own_shard_and_the_cursor_follows(tmp_path):
    """ctx.next_batch() (a refill) takes the controller's next part of its shard; the loop's next batch comes
    after it, and a checkpoint taken after the step resumes past both."""
    from yatt_controller.controller import ControllerCore, ControllerPlan

    drawn = []

    def step(ctx, batch):
        extra = ctx.next_batch() if ctx.step == 0 else []
        drawn.append((batch, extra))
        return {"n": float(len(batch) + len(extra))}

    rows = [f"row{i}" for i in range(12)]
    plan = ControllerPlan(
        rank=0,
        world_size=1,
        step_fn=step,
        dataset=lambda: rows,
        batch_size=4,
        shards=[0],
        num_shards=1,
        seed=5,
        services={},
        checkpoint_dir=str(tmp_path),
        checkpoint_every=1,
    )
    core = ControllerCore(plan)
    assert core.run(0, 2) == 2
    reference = ShardSampler(12, 4, seed=5)
    expected = [[rows[i] for i in reference.next()] for _ in range(3)]  # 3 steps per epoch of 12 rows
    assert drawn == [(expected[0], expected[1]), (expected[2], [])]
    assert core.sampler.state() == {"epoch": 0, "step_in_epoch": 3}
    resumed = ControllerCore(plan)
    assert resumed.prepare(checkpoint.latest(str(tmp_path))[0]) == 2
    assert resumed.sampler.state() == {"epoch": 0, "step_in_epoch": 3}


def _crash_while_writing(root: str) -> None:
    class Exploding(dict):
        def items(self):
            yield "a.bin", b"A" * 100
            os._exit(3)  # the process dies after one file of the checkpoint is on disk

    checkpoint.write_checkpoint(root, 2, Exploding(), keep=2)


def test_checkpoint_atomic_under_a_real_crash(tmp_path):
    root = tmp_path / "ckpt"
    first = checkpoint.write_checkpoint(root, 1, {"a.bin": b"one", "sub/b.bin": b"two"}, policy_version=4)
    child = multiprocessing.get_context("fork").Process(target=_crash_while_writing, args=(str(root),))
    child.start()
    child.join()
    assert child.exitcode == 3
    assert sorted(p.name for p in root.iterdir()) == [".staging-step-00000002", "step-00000001"]
    path, manifest = checkpoint.latest(root)
    assert path == first and manifest.step == 1 and manifest.policy_version == 4
    assert manifest.sizes == {"a.bin": 3, "sub/b.bin": 3}
    assert (path / "sub" / "b.bin").read_bytes() == b"two"
    # the next write of step 2 replaces the leftover staging directory
    checkpoint.write_checkpoint(root, 2, {"a.bin": b"new"})
    assert checkpoint.latest(root)[1].step == 2


def test_stale_staging_directories_of_other_steps_are_removed(tmp_path):
    checkpoint.write_checkpoint(tmp_path, 2, {"x.bin": b"2"})
    # left by crashed attempts: steps 3 and 9 (9 is ahead of where the resumed run is: it died there)
    for step in (3, 9):
        (checkpoint.staging_dir(tmp_path, step) / "learner").mkdir(parents=True)
    staged = checkpoint.begin(tmp_path, 5)  # begin removes the later step's (9); 3 may still be in flight
    assert checkpoint.staging_steps(tmp_path) == [3, 5]
    checkpoint.commit(tmp_path, 5, {"x.bin": checkpoint.write_file(staged, "x.bin", b"5")})
    # the commit of 5 supersedes 3: only complete checkpoints are left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000005"]


def test_checkpoint_keep_last_k_and_skip_corrupt(tmp_path):
    for step in range(5):
        checkpoint.write_checkpoint(tmp_path, step, {"x.bin": bytes([step])}, keep=3)
    assert checkpoint.complete_steps(tmp_path) == [2, 3, 4]
    (tmp_path / "step-00000004" / "x.bin").write_bytes(b"\xff\xff")  # corrupted after the fact
    with pytest.raises(ValueError, match=re.escape("x.bin does not match its manifest entry")):
        checkpoint.verify(tmp_path / "step-00000004")
    assert checkpoint.latest(tmp_path)[1].step == 3
    (tmp_path / "step-00000003" / checkpoint.MANIFEST).unlink()
    assert checkpoint.latest(tmp_path)[1].step == 2
    manifest = msgspec.json.decode((tmp_path / "step-00000002" / "manifest.json").read_bytes())
    assert (
        manifest["files"]["x.bin"] == "dbc1b4c900ffe48d575b5da5c638040125f65db0fe3e24494b76ea986457d986"
    )  # sha256(b"\x02")
    with pytest.raises(
        ValueError, match=re.escape("must be a relative path inside the checkpoint, got '../x'")
    ):
        checkpoint.write_checkpoint(tmp_path, 9, {"../x": b""})


def test_check_versions():
    check_versions([3, 3], 3)
    check_versions([2, 3], 3, max_staleness=1)
    with pytest.raises(
        StaleSampleError, match="samples of policy versions \\[2\\] in a step that expects version 3"
    ):
        check_versions([3, 2, 2], 3)
    with pytest.raises(StaleSampleError, match="versions \\[4\\]"):
        check_versions([4], 3, max_staleness=1)  # newer than expected is just as wrong


def test_weight_buckets_by_dtype_roundtrip_bit_exact():
    torch = pytest.importorskip("torch")
    from yatt_controller import weight_sync

    g = torch.Generator().manual_seed(0)
    named = [
        ("a", torch.randn(4, 8, generator=g)),  # float32, 128 bytes
        ("b", torch.randn(3, generator=g).to(torch.bfloat16)),  # 6 bytes
        ("c", torch.randn(16, generator=g)),  # float32, 64 bytes
        ("d", torch.arange(5)),  # int64, 40 bytes
        ("e", torch.randn(2, 2, generator=g)),  # float32, 16 bytes
    ]
    buckets = weight_sync.plan_buckets(named, bucket_bytes=150)
    # float32 first (first seen): a (128) | c (64) + e (16) -- a + c would be 192 > 150; then bf16, int64
    assert [(b.dtype, b.names, b.nbytes) for b in buckets] == [
        ("float32", ["a"], 128),
        ("float32", ["c", "e"], 80),
        ("bfloat16", ["b"], 6),
        ("int64", ["d"], 40),
    ]
    tensors = dict(named)
    out = dict(pair for b in buckets for pair in weight_sync.unpack(weight_sync.pack(tensors, b), b))
    for name, tensor in named:
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert out[name].view(torch.uint8).equal(tensor.view(torch.uint8))  # bit for bit
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        weight_sync.plan_buckets(named, 0)


def test_weight_sync_store_listens_on_the_given_host_only():
    pytest.importorskip("torch")
    import socket

    from yatt_controller import weight_sync

    store = weight_sync.listen_store("127.0.0.1")
    client = type(store)("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    # the port is bound on localhost alone: the same port is still free on every other interface (read from
    # the interfaces themselves: Ray's node address is 127.0.0.1 once a local Ray ran in this process)
    import psutil

    others = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if not others:
        pytest.skip("this machine has no IPv4 interface besides loopback")
    other = others[0]
    with socket.socket() as probe:
        probe.bind((other, store.port))  # EADDRINUSE if the store listened on every interface


def test_the_runtime_imports_no_torch():
    # controllers and the driver never load torch: only yatt_controller.weight_sync does, inside the hosts
    import json
    import subprocess
    import sys

    code = (
        "import json, sys, yatt_controller.runner, yatt_controller.sync\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _saved(rank: int, step_in_epoch: int, **state) -> dict:
    return {
        "policy_version": 6,
        "sampler": {"epoch": 1, "step_in_epoch": step_in_epoch},
        "rng": [3, [rank] * 3, None],
        "state": state,
        "reports": [f"r{rank}"],
    }


def test_controller_state_resplits_over_another_number_of_controllers():
    from yatt_controller.controller_checkpoint import resplit
    from yatt_controller.data import ShardSampler

    two = [_saved(0, 3, kl_coef=0.2), _saved(1, 3, kl_coef=0.2)]
    assert resplit(two, 1, 2) is two[1]  # the same number: its own
    one = resplit(two, 0, 1)
    assert one == {**two[0], "reports": ["r0"]}
    three = [resplit(two, r, 3) for r in range(3)]
    assert [s["rng"] for s in three] == [two[0]["rng"], two[1]["rng"], None]  # None: its own seeded RNG
    assert [s["state"] for s in three] == [{"kl_coef": 0.2}] * 3 and three[2]["reports"] == []
    # the cursor is global: 2 controllers resumed as 3 draw the same prompts as the run that went on with 2
    went_on = [ShardSampler(60, 12, seed=5, num_shards=2, shards=(r,)) for r in range(2)]
    resumed = [ShardSampler(60, 12, seed=5, num_shards=3, shards=(r,)) for r in range(3)]
    for sampler in went_on:
        sampler.load_state(two[0]["sampler"])
    for sampler, state in zip(resumed, three, strict=True):
        sampler.load_state(state["sampler"])
    for _ in range(4):  # across the epoch's end (5 batches of 12 in 60 rows)
        assert sorted(i for s in resumed for i in s.next()) == sorted(i for s in went_on for i in s.next())


def test_controller_resplit_takes_the_furthest_cursor_and_refuses_what_cannot_split():
    from yatt_controller.controller_checkpoint import resplit

    refilled = [_saved(0, 2), _saved(1, 4)]  # DAPO: controller 1 drew two refill parts more
    assert resplit(refilled, 0, 1)["sampler"] == {"epoch": 1, "step_in_epoch": 4}
    versions = [_saved(0, 2), {**_saved(1, 2), "policy_version": 5}]
    with pytest.raises(ValueError, match=r"ck: its controllers saved different policy versions \[5, 6\]"):
        resplit(versions, 0, 1, "ck")
    queued = [_saved(0, 2, async_queue=[{"rows": []}]), _saved(1, 2)]
    with pytest.raises(ValueError, match=r"resume with controller\.num_controllers=2"):
        resplit(queued, 0, 1, "ck")
