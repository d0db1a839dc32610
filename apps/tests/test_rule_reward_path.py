"""What a step with rule rewards only does not pay for: a second generation pass per replica (one chunk per
rollout replica: there is no judge to overlap), reward calls queued behind the engine's generate call on the
same host (the rules' own lock group), and the rule workers' start-up inside the first step (started with
the reward worker). bench_e2e measures the step these make (README, "Asynchronous training")."""

import msgspec
import torch
from yatt_apps.config import RunConfig, tiny_cpu
from yatt_apps.runtime.job import reward_lock
from yatt_apps.runtime.phases import chunks_per_replica, num_chunks, pad_batch
from yatt_apps.runtime.workers import RewardWorker


def _rules_only(cfg: RunConfig) -> RunConfig:
    return msgspec.structs.replace(cfg, judge=None, rewards=[r for r in cfg.rewards if r.kind != "genrm"])


def test_rule_rewards_take_one_chunk_per_replica_and_a_judge_two():
    judged = tiny_cpu()
    assert judged.judge is not None
    assert chunks_per_replica(judged) == 2
    assert chunks_per_replica(_rules_only(judged)) == 1
    # 32 prompts on 2 replicas: 4 chunks with a judge, 2 without; never more chunks than prompts
    assert num_chunks(32, 2, chunks_per_replica(judged)) == 4
    assert num_chunks(32, 2, chunks_per_replica(_rules_only(judged))) == 2
    assert num_chunks(1, 2, 2) == 1 and num_chunks(3, 4, 1) == 3
    assert num_chunks(0, 1, 1) == 1  # an empty shard still makes one (empty) call


def test_rule_rewards_run_in_their_own_host_lock_group():
    judged = tiny_cpu()
    assert reward_lock(_rules_only(judged), RewardWorker) == "rules"
    assert reward_lock(judged, RewardWorker) == "host"  # the judge's engine beside the policy's

    class OwnReward(RewardWorker):  # another class may hold a model: it shares the engines' group
        pass

    assert reward_lock(_rules_only(judged), OwnReward) == "host"


def test_pad_batch_right_pads_and_marks_the_response_tokens():
    # worked by hand: prompt [5, 6] + response [7] -> width 4 (the longest row: [1] + [2, 3, 4]); an empty
    # response marks no token
    batch = pad_batch([[5, 6], [1], [8, 9, 10]], [[7], [2, 3, 4], []], 0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [1, 2, 3, 4], [8, 9, 10, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]]
    assert (batch["input_ids"].dtype, batch["response_mask"].dtype) == (torch.long, torch.bool)
