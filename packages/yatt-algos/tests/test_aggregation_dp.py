"""Data parallelism over real torch.distributed (gloo, 2 processes): each rank aggregates its uneven shard
with the global counts (all-reduced from the local ones), the gradients are summed by all_reduce, and the
result equals the one-process gradient of the whole batch, for every aggregation mode."""

import json
import subprocess
import sys

import pytest
import torch
from yatt_algos.aggregation import AGG_MODES, aggregate

# The rank's program, run as `python -c` so that it needs nothing from this test module.
_RANK = r"""
import json, sys, torch, torch.distributed as dist
from yatt_algos.aggregation import AGG_MODES, aggregate
rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
gen = torch.Generator().manual_seed(0)
lengths = torch.tensor([3, 9, 1, 5, 12, 2, 7])
features, weight = torch.randn(7, 12, 5, generator=gen), torch.randn(5, generator=gen)
rows = slice(0, 3) if rank == 0 else slice(3, 7)  # 3 rows and 4 rows
t = int(lengths[rows].max())  # each rank pads only to its own longest row
mask = torch.arange(t).unsqueeze(0) < lengths[rows].unsqueeze(-1)
counts = torch.tensor([float(mask.sum()), float(mask.any(-1).sum())], dtype=torch.float64)
dist.all_reduce(counts)
max_len = torch.tensor([t])
dist.all_reduce(max_len, op=dist.ReduceOp.MAX)
grads = {}
for mode in sorted(AGG_MODES):
    w = weight.clone().requires_grad_(True)
    loss = aggregate((features[rows, :t] @ w).square(), mask, mode,
                     num_tokens=float(counts[0]), num_seqs=float(counts[1]), max_len=int(max_len))
    loss.backward()
    dist.all_reduce(w.grad)
    grads[mode] = w.grad.tolist()
dist.destroy_process_group()
json.dump(grads, open(out, "w"))
"""


@pytest.mark.slow  # two fresh torch processes and a gloo rendezvous
def test_two_gloo_ranks_match_one_batch(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK, str(r), init, str(outs[r])], stderr=subprocess.PIPE)
        for r in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()[-2000:]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 9, 1, 5, 12, 2, 7])
    features, weight = torch.randn(7, 12, 5, generator=gen), torch.randn(5, generator=gen)
    mask = torch.arange(12).unsqueeze(0) < lengths.unsqueeze(-1)
    ranks = [json.loads(o.read_text()) for o in outs]
    for mode in sorted(AGG_MODES):
        w = weight.clone().requires_grad_(True)
        aggregate((features @ w).square(), mask, mode).backward()
        for got in ranks:  # after the all-reduce every rank holds the one-batch gradient
            torch.testing.assert_close(torch.tensor(got[mode]), w.grad, rtol=1e-5, atol=1e-6)
