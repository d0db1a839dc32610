"""Rule rewards with hard limits: a math answer that hangs sympy gets status "timeout" from a killed and
replaced worker while the rest of the batch scores; errors stay per request; no "Timeout is disabled" notice;
pools are objects that close their processes."""

import asyncio
import logging
import os
import time
from functools import partial

import pytest
from yatt_multimodal.reward_specs import build_combined
from yatt_multimodal.rewards import RuleReward
from yatt_multimodal.rule_workers import RuleWorkerPool, gathered
from yatt_multimodal.rules import build_rule, regex_reward
from yatt_multimodal.types import RewardRequest, RewardSpec

pytest.importorskip("math_verify")

# sympy expands the power: minutes in one call (a numeric power tower no longer gets that far: `oversized_answer`)
HANGS = "\\boxed{(x+1)^{100000}}"


def _req(response, rid, reference="5"):
    return RewardRequest(request_id=rid, prompt="What is 2+3?", response=response, reference=reference)


@pytest.fixture(scope="module")
def pool():
    with RuleWorkerPool(num_workers=2) as shared:
        yield shared


def test_a_hanging_answer_times_out_and_the_pool_serves_the_next_request(pool):
    reward = build_rule(RewardSpec(kind="math_verify"), timeout_s=2.0, pool=pool)
    restarts = pool.restarts
    requests = [_req(HANGS, "hostile"), _req("so \\boxed{5}", "right"), _req("\\boxed{4}", "wrong")]
    batch = asyncio.run(reward.score(requests))
    assert [(r.request_id, r.status, r.score) for r in batch.rewards] == [
        ("hostile", "timeout", 0.0),
        ("right", "ok", 1.0),
        ("wrong", "ok", 0.0),
    ]
    assert batch.rewards[0].error.startswith("math_verify: no result within 2.0s")
    assert (batch.metrics.num_requests, batch.metrics.num_timeout, batch.metrics.num_error) == (3, 1, 0)
    assert pool.restarts == restarts + 1  # the stuck worker was killed and replaced
    # the pool still serves, with both workers: two more requests in one synchronous batch
    after = reward.score_sync([_req("\\boxed{\\frac{10}{2}}", "a"), _req("\\boxed{6}", "b")])
    assert [(r.status, r.score) for r in after.rewards] == [("ok", 1.0), ("ok", 0.0)]
    assert len(pool.worker_pids()) == 1 + 2  # the supervisor and its two workers


def test_a_runaway_power_is_wrong_at_once_on_the_jobs_reward_path(pool):
    """The answers the tiny GRPO job's policy wrote (each a 10 s timeout before `oversized_answer`) score 0
    with status ok through the pool, as a job's reward worker runs them: no deadline reached, no worker
    killed."""
    reward = build_rule(RewardSpec(kind="math_verify"), timeout_s=2.0, pool=pool)
    restarts = pool.restarts
    runaway = ["42^4441444444444", "44447472^4444444", "\\boxed{9^{9^{9^{9}}}}", "99999999999!"]
    batch = reward.score_sync([_req(text, f"r{i}", reference="12") for i, text in enumerate(runaway)])
    assert [(r.status, r.score) for r in batch.rewards] == [("ok", 0.0)] * len(runaway)
    assert batch.metrics.num_timeout == 0 and pool.restarts == restarts


def test_jobs_queued_behind_a_hanging_one_on_its_worker_go_to_the_next_worker():
    """A worker gets several jobs at once (they run without a round trip through the supervisor between them);
    when one hangs, only it times out: the jobs queued behind it go back and are answered by the replacement,
    each against its own deadline."""
    with RuleWorkerPool(num_workers=1) as alone:
        reward = build_rule(RewardSpec(kind="math_verify"), timeout_s=1.0, pool=alone)
        answers = ["\\boxed{5}", HANGS, "so \\boxed{5}", "\\boxed{4}", "5"]
        batch = reward.score_sync([_req(a, str(i)) for i, a in enumerate(answers)])
        assert [(r.status, r.score) for r in batch.rewards] == [
            ("ok", 1.0),
            ("timeout", 0.0),
            ("ok", 1.0),
            ("ok", 0.0),
            ("ok", 1.0),
        ]
        assert alone.restarts == 1


def test_a_replaced_worker_serves_every_later_batch():
    """Each batch holds a hanging answer, so each kills and replaces the worker: the replacement answers its
    first chunk and every batch after it. (A replaced worker's socket once stayed tied to a copy of its slot:
    the supervisor never saw it finish a chunk again, so a one-worker pool hung on its second batch, and a
    pool of n after n timeouts.)"""
    for workers in (1, 2):
        with RuleWorkerPool(num_workers=workers) as small:
            reward = build_rule(RewardSpec(kind="math_verify"), timeout_s=1.0, pool=small)
            for batch_index in range(workers + 2):
                requests = [_req("\\boxed{5}", "a"), _req(HANGS, "b"), _req("\\boxed{4}", "c")]
                # a hung pool raises TimeoutError here (each batch needs about one deadline)
                outcomes = gathered(small.submit_many(reward.fn, requests, reward.timeout_s)).result(
                    timeout=30
                )
                assert [(o.status, o.value) for o in outcomes] == [
                    ("ok", 1.0),
                    ("timeout", 0.0),
                    ("ok", 0.0),
                ], (workers, batch_index)
                assert small.restarts == batch_index + 1
            assert len(small.worker_pids()) == 1 + workers


def test_answers_held_for_one_write_come_back_whole_and_once():
    """A worker writes its chunk's answers to the caller together, in writes of at most PIPE_BUF bytes (two
    workers share the results pipe, and a longer write could interleave with the other's): answers of about
    1.8 kB each (an error cut at 500 characters of 4-byte emoji) arrive whole, one per request, in order."""
    mode = "\U0001f600" * 600
    rule = partial(regex_reward, pattern="5", mode=mode)
    expected = "ValueError: " + f"regex_reward: option 'mode' must be search or fullmatch, got {mode!r}"[:500]
    with RuleWorkerPool(num_workers=2) as two:
        outcomes = gathered(two.submit_many(rule, [_req("5", str(i)) for i in range(16)], 5.0)).result(60)
        assert [(o.status, o.error) for o in outcomes] == [("error", expected)] * 16
        assert two.restarts == 0
        # the pool goes on: a batch of ordinary answers, in order
        fine = two.submit_many(
            partial(regex_reward, pattern="^5$"), [_req(str(i), str(i)) for i in range(9)], 5
        )
        assert [o.value for o in gathered(fine).result(60)] == [0.0] * 5 + [1.0] + [0.0] * 3


def _cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_worker_that_dies_mid_chunk_fails_its_job_and_the_rest_run_again():
    """The worker dies (SIGKILL from outside) inside the second job of its chunk, whose first answer it held
    for the chunk's one write: the running job is an "error" naming the signal, the first and third run again
    on the replacement."""
    import signal

    with RuleWorkerPool(num_workers=1) as alone:
        alone.start()
        while len(alone.worker_pids()) < 2:  # the supervisor has warmed up and forked its worker
            time.sleep(0.05)
        rule = partial(regex_reward, pattern="(a+)+$")  # backtracks for minutes on many a's and a "!"
        futures = alone.submit_many(rule, [_req("aaa", "0"), _req("a" * 40 + "!", "1"), _req("b", "2")], 60.0)
        worker = alone.worker_pids()[1]
        while _cpu_s(worker) < 0.5:  # job 0 answered (held for the chunk's write), job 1 backtracking
            time.sleep(0.05)
        os.kill(worker, signal.SIGKILL)
        outcomes = gathered(futures).result(60)
        assert [(o.status, o.value) for o in outcomes] == [("ok", 1.0), ("error", 0.0), ("ok", 0.0)]
        assert outcomes[1].error == "rule worker died (signal SIGKILL)"
        assert alone.restarts == 1


def test_the_supervisors_warm_up_runs_every_answer_shape_through_to_a_verdict():
    """The warm-up pays each parse path's first-call cost (5-30 ms: an expression, an equation, a fraction in
    words) before the workers fork: each of its answers must be one math_verify parses and accepts, or the
    path it stands for would stay cold until a step's first answer of that shape."""
    from yatt_multimodal.math_answers import verify_math
    from yatt_multimodal.rule_workers import _WARM_UP_ANSWERS

    assert len(_WARM_UP_ANSWERS) == 5
    assert [verify_math(response, reference) for response, reference in _WARM_UP_ANSWERS] == [True] * 5
    assert [verify_math(response, "999") for response, _ in _WARM_UP_ANSWERS] == [False] * 5


def test_math_verify_prints_no_timeout_disabled_notice(pool, capfd, caplog):
    import math_verify.grader
    import math_verify.parser

    # math-verify warns once per process; make this process warn again if the notice is not filtered
    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = False
    with caplog.at_level(logging.WARNING):
        in_process = build_rule(RewardSpec(kind="math_verify"))  # no pool given: its own, closed below
        assert in_process.score_sync([_req("\\boxed{5}", "a")]).rewards[0].score == 1.0
        in_process.close()
        from yatt_multimodal.math_answers import verify_math

        assert verify_math("\\boxed{5}", "5") is True  # in this process, math_verify's timeouts off
    shared = build_rule(RewardSpec(kind="math_verify"), pool=pool).score_sync([_req("\\boxed{4}", "b")])
    assert shared.rewards[0].score == 0.0
    assert not [r for r in caplog.records if "Timeout is disabled" in r.getMessage()]
    out, err = capfd.readouterr()  # the workers' stderr is this process's fd 2
    assert "Timeout is disabled" not in out + err


def test_rule_errors_and_unsendable_rules_fail_their_request_only(pool):
    bad_mode = build_rule(RewardSpec(kind="regex", options={"pattern": "5", "mode": "everywhere"}), pool=pool)
    batch = bad_mode.score_sync([_req("5", "a")])
    assert (batch.rewards[0].status, batch.metrics.num_error) == ("error", 1)
    assert batch.rewards[0].error == (
        "regex: ValueError: regex_reward: option 'mode' must be search or fullmatch, got 'everywhere'"
    )
    unsendable = RuleReward("closure", lambda request: float(request.response == "5"), pool=pool)
    reward = unsendable.score_sync([_req("5", "b")]).rewards[0]
    assert reward.status == "error" and "cannot be sent to a worker" in reward.error
    sendable = RuleReward("partial", partial(regex_reward, pattern="^5$"), pool=pool)
    assert sendable.score_sync([_req("5", "c")]).rewards[0].score == 1.0


def test_build_combined_shares_one_pool_and_close_stops_its_processes():
    combined = build_combined([RewardSpec(kind="math_verify"), RewardSpec(kind="boxed_format", weight=0.5)])
    (pool,) = combined.owns
    assert all(term.pool is pool for _, term in combined.terms)
    batch = asyncio.run(combined.score([_req("\\boxed{5}", "a"), _req("\\boxed{4}", "b")]))
    assert [r.score for r in batch.rewards] == [1.5, 0.5]  # 1 + 0.5 * 1 (boxed); 0 + 0.5 * 1
    pids = pool.worker_pids()
    assert len(pids) == 1 + 4
    combined.close()
    for pid in pids:  # the supervisor waited for its workers before exiting, and was waited for
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match=r"RuleWorkerPool\.submit after close"):
        pool.submit(combined.terms[0][1].fn, _req("\\boxed{5}", "c"), 1.0)


def test_pool_arguments_are_checked():
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        RuleWorkerPool(num_workers=0)
    with pytest.raises(ValueError, match="memory_limit_mb must be >= 256 or None, got 10"):
        RuleWorkerPool(memory_limit_mb=10)
    with RuleWorkerPool(1) as pool, pytest.raises(ValueError, match="deadline_s must be > 0, got 0"):
        pool.submit(regex_reward, _req("5", "a"), 0)


CALLER = """
import sys
import time
from yatt_multimodal.rule_workers import RuleWorkerPool, gathered
from yatt_multimodal.rules import math_reward
from yatt_multimodal.types import RewardRequest

pool = RuleWorkerPool(num_workers=2)
pool.submit(math_reward, RewardRequest(request_id="h", prompt="q", response=sys.argv[1], reference="3"), 600)
while len(pids := pool.worker_pids()) < 3:  # the supervisor and both workers forked
    time.sleep(0.05)
print(*pids, flush=True)
sys.stdin.read()  # until killed
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_caller_killed_with_sigkill_takes_its_supervisor_and_workers_with_it():
    import signal
    import subprocess
    import sys

    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, HANGS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    pids = [int(p) for p in caller.stdout.readline().split()]
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    for _ in range(600):  # waits for the kernel and the supervisor's pipe EOF, at most 60 s
        if not any(_alive(p) for p in pids):
            break
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []
