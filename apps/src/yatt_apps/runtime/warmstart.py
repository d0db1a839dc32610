"""Warm-started tiny models: a short in-process SFT of the tiny policy and judges on the embedded task.

A randomly initialized tiny policy never answers "a + b =" correctly, so GRPO on it has nothing to reinforce,
and a random tiny judge never states a verdict. The tiny presets therefore warm-start each tiny model
(`ModelSpec.warm_start`, `warm_start_steps`) with plain torch in the driver process (no Ray: fastest):

- "policy": on worked answers of the arithmetic task (response = the answer), stopped early so that it starts
  with some greedy accuracy and headroom for RL;
- "genrm": as the tiny presets' GenRM (`TINY_JUDGE`, verify_yes_no v2: the solution last, next to the verdict;
  with v1's solution-then-instruction order the tiny judge stayed at "always No"): (problem, candidate answer,
  verdict) rendered exactly as the GenRM's prompt (template + `HFChatCodec`), the candidate right or close to
  right (off by small amounts, sign slips) or malformed like a tiny policy's outputs, the target
  `Verdict: Yes` / `Verdict: No` as `math_verify` says;
- "step_critique": as CAPO's step critic (`TINY_CRITIC`, step_critique v2), the target `Wrong steps: none` or the
  wrong step numbers.

The result is cached under `$YATT_CACHE_DIR` (default `~/.cache/yatt/models`) in a folder named by a hash of
the spec, the tokenizer corpus, the task and this module's settings and the YATT versions, written atomically
(tmp + rename): a second run, and every test, reuses it. The default presets' policy and judge ship with the
package (`runtime.shipped`) and are copied into the cache instead of trained. A warm start that has to run says so on stderr and
shows a bar of its steps (transformers' own bars are turned off: `progress.quiet_transformers`).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from yatt_apps.config import ModelSpec
from yatt_apps.io.data import PromptRow, arithmetic_task
from yatt_apps.io.sft_data import chat_messages, encode_pair, masked_nll, pad_examples

TASK_ROWS = 2048  # distinct problems drawn for the warm start (the task has 21 * 21 * 2 of them)
TASK_SEED = 20_000  # apart from the run's train (seed) and validation (seed + 10_000) draws
FORMAT_VERSION = 2  # bump when the data or training below changes: the cache key includes it
VERDICTS = ("Verdict: Yes", "Verdict: No")
# ModelSpec fields that say how a model is served or planned, not what its weights are: left out of the cache
# key (a run at tensor_parallel=2 or on vLLM reuses the same warm-started model)
SERVING_FIELDS = (
    "num_params",
    "tensor_parallel",
    "pipeline_parallel",
    "trust_remote_code",
    "engine",
    "dtype",
)
JUDGE_PROMPT_WEIGHT = 0.2  # judges also learn their prompts' tokens at this weight (see `sft_steps`)


def cache_root() -> Path:
    return Path(os.environ.get("YATT_CACHE_DIR") or Path.home() / ".cache" / "yatt" / "models")


def cache_key(spec: ModelSpec, corpus: list[str]) -> str:
    """Hash of everything that shapes the warm-started model."""
    from importlib.metadata import version

    versions = [version(p) for p in ("yatt-apps", "yatt-multimodal", "yatt-rollout", "transformers", "torch")]
    shaping = {k: v for k, v in msgspec.to_builtins(spec).items() if k not in SERVING_FIELDS}
    doc = [shaping, corpus, TASK_ROWS, TASK_SEED, FORMAT_VERSION, versions]
    return hashlib.sha256(msgspec.json.encode(doc)).hexdigest()[:16]


def judge_template(kind: str) -> Any:
    """The template a warm-started judge is trained on: the tiny presets' GenRM (`TINY_JUDGE`) or CAPO critic
    (`TINY_CRITIC`) template, so the warm start and the run render the same prompts."""
    from yatt_multimodal.templates import get_template

    from yatt_apps.config import TINY_CRITIC, TINY_JUDGE

    spec = TINY_JUDGE if kind == "genrm" else TINY_CRITIC
    return get_template(spec.template_name, spec.template_version)


def extra_corpus(spec: ModelSpec) -> list[str]:
    """Text a judge's tokenizer also trains on: its template and verdict phrases (shorter prompts)."""
    if spec.warm_start not in ("genrm", "step_critique"):
        return []
    tpl = judge_template(spec.warm_start)
    phrases = list(VERDICTS) if spec.warm_start == "genrm" else ["Wrong steps: none", "Wrong steps: 1"]
    return [tpl.system, tpl.user, *phrases] * 50


def extra_tokens(spec: ModelSpec) -> list[str]:
    """A judge's tokenizer reads every integer in -99..99 as one token (as large tokenizers read short numbers),
    so "is the candidate the reference" is a comparison of two tokens, which a tiny judge learns quickly."""
    return [str(i) for i in range(-99, 100)] if spec.warm_start in ("genrm", "step_critique") else []


def cached_or_build(spec: ModelSpec, out: Path, corpus: list[str], build: Any) -> Path:
    """`out` holds the warm-started model: copied from the cache, or built by `build()`, warm-started,
    and stored in the cache first (both writes atomic)."""
    cached = cache_root() / f"{spec.warm_start}-{cache_key(spec, corpus)}"
    from yatt_apps.runtime import shipped

    source = None if os.environ.get("YATT_NO_SHIPPED") else shipped.find(spec, corpus)
    if source is not None and not (cached / "config.json").is_file():  # the package's own copy: no training
        store(cached, lambda tmp: shutil.copytree(source, tmp))
    if not (cached / "config.json").is_file():
        from yatt_apps.runtime.progress import quiet_transformers

        quiet_transformers()  # no "Writing model shards" bar from `save_tiny` below
        # minutes of CPU the first time (and again when the tokenizer's text changes, e.g. with data.train):
        # said, and shown as a bar of its steps, never silent
        print(
            f"warm-starting the tiny {spec.warm_start} model ({spec.warm_start_steps} steps; once, then cached "
            f"in {cached})",
            file=sys.stderr,
            flush=True,
        )
        model, tok = build()
        started, cpu = time.perf_counter(), time.process_time()
        report = warm_start(spec, model, tok)
        # wall seconds, and this process's CPU seconds (what the warm start costs on an idle machine)
        report["seconds"], report["cpu_seconds"] = time.perf_counter() - started, time.process_time() - cpu
        report["ship_key"] = shipped.ship_key(spec, corpus)  # its name if shipped (`shipped.rebuild`)
        store_model(cached, model, tok, report)
    tmp_out = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp_out, ignore_errors=True)
    shutil.copytree(cached, tmp_out)
    tmp_out.replace(out)
    return out


# ---- data -------------------------------------------------------------------------------------------------


def store(cached: Path, write: Callable[[Path], Any]) -> None:
    """Store a cache entry atomically: `write(tmp)` fills this process's own folder, which then takes the
    entry's name. Another process that stored the same key first wins (its entry is as good)."""
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    cached.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.replace(cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def store_model(cached: Path, model: Any, tok: Any, report: dict[str, Any]) -> None:
    """A warm-started model, its tokenizer and its report (`warm_start.json`) as the cache entry `cached`."""
    from yatt_rollout.tiny import save_tiny

    def write(tmp: Path) -> None:
        save_tiny(model, tok, tmp)
        (tmp / "warm_start.json").write_bytes(msgspec.json.encode(report))

    store(cached, write)


def near_miss(rng: random.Random, row: PromptRow) -> str:
    """A candidate answer as a partly trained tiny policy writes it: right, close to right, or malformed."""
    ans = int(row.answer)
    a, op, b = row.prompt.split()[:3]
    r = rng.random()
    if r < 0.4:
        return row.answer
    if r < 0.65:
        return str(ans + rng.choice((-2, -1, 1, 2, -10, 10)))
    if r < 0.75:
        return str(int(a) - int(b) if op == "+" else int(a) + int(b)) if int(b) else str(ans + 1)
    if r < 0.8:
        return str(-ans) if ans else "1"
    if r < 0.88:
        return str(rng.randint(-20, 40))
    digit = str(rng.randint(0, 9))
    return rng.choice(
        (
            f"{ans}{digit}",
            f"{digit}{ans}",
            f"{ans} {digit}",
            f"{ans} -",
            f"{ans} =",
            "-",
            "=",
            f"{digit} +",
            f"{a} {op}",
        )
    )


def is_correct(candidate: str, reference: str) -> bool:
    """math_verify's verdict (the rule the judge is measured against); plain integers compared directly."""
    from yatt_multimodal.math_answers import verify_math

    if candidate.lstrip("-").isdigit() and candidate.count("-") <= 1:
        return int(candidate) == int(reference)
    return bool(candidate.strip()) and verify_math(candidate, reference)


def policy_examples(tok: Any, rows: list[PromptRow]) -> list[tuple[list[int], list[int]]]:
    return [encode_pair(tok, chat_messages("", r.prompt), r.answer) for r in rows]


def judge_examples(tok: Any, rows: list[PromptRow], rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """`TINY_JUDGE`'s prompts exactly as `GenRMJudge.build_prompt` + `HFChatCodec` render them."""
    tpl = judge_template("genrm")
    out = []
    for row in rows:
        candidate = near_miss(rng, row)
        system, user = tpl.render(question=row.prompt, response=candidate, reference=row.answer)
        verdict = VERDICTS[0] if is_correct(candidate, row.answer) else VERDICTS[1]
        out.append(encode_pair(tok, chat_messages(system, user), verdict))
    return out


def critic_examples(tok: Any, rows: list[PromptRow], rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """step_critique prompts exactly as `GenPRM._prompt` + `HFChatCodec` render them; a one-step answer is
    wrong step 1 unless it is right."""
    from yatt_multimodal.genprm import number_steps, split_steps

    tpl = judge_template("step_critique")
    out = []
    for row in rows:
        candidate = near_miss(rng, row)
        spans = split_steps(candidate)
        if not spans:
            continue
        system, user = tpl.render(
            question=row.prompt,
            response=candidate,
            reference=row.answer,
            steps=number_steps(candidate, spans),
            num_steps=len(spans),
        )
        wrong = (
            "none" if is_correct(candidate, row.answer) else ", ".join(str(i + 1) for i in range(len(spans)))
        )
        out.append(encode_pair(tok, chat_messages(system, user), f"Wrong steps: {wrong}"))
    return out


# ---- training ---------------------------------------------------------------------------------------------


def sft_steps(
    model: Any,
    examples: list,
    pad_id: int,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    prompt_weight: float = 0.0,
    desc: str = "",
    stop: int | None = None,
    pad: Callable[[list, int], dict[str, Any]] = pad_examples,
) -> list[float]:
    """Plain-torch SFT: AdamW, linear warmup over the first tenth, constant after, clipping at 1.0. With
    `prompt_weight` > 0 the prompt tokens are also targets at that weight (a response token weighs 1): a judge
    then also learns to predict the candidate from the reference, which shortens its plateau. A `desc` shows a
    progress bar of the steps (on stderr) under that name. `stop`: run only the first `stop` steps of that
    schedule (a reproducibility check of a long warm start's beginning). `pad` makes a batch of examples
    (default: (prompt ids, response ids) pairs; `sft_data.pad_masked` for (ids, loss mask) pairs)."""
    import torch
    from tqdm import tqdm

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(steps // 10, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    losses = []
    run = steps if stop is None else min(stop, steps)
    for _ in tqdm(range(run), desc=desc, unit="step", disable=not desc, dynamic_ncols=True):
        batch = pad([examples[rng.randrange(len(examples))] for _ in range(batch_size)], pad_id)
        loss = masked_nll(model, batch) if not prompt_weight else weighted_nll(model, batch, prompt_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def weighted_nll(model: Any, batch: dict[str, Any], prompt_weight: float) -> Any:
    """Token NLL with response tokens at weight 1 and the other real tokens (the prompt) at `prompt_weight`."""
    from yatt_apps.io.sft_data import token_nll

    response = batch["response_mask"].float()
    weight = batch["attention_mask"].float() * prompt_weight * (1.0 - response) + response
    weight[:, 0] = 0.0  # the first token has no prediction
    return (token_nll(model, batch) * weight).sum() / weight.sum()


def response_accuracy(model: Any, examples: list, pad_id: int) -> float:
    """Fraction of examples whose whole response is the greedy (argmax) continuation, teacher-forced."""
    import torch

    batch = pad_examples(examples, pad_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits
    right = (logits[:, :-1].argmax(-1) == batch["input_ids"][:, 1:]) | ~batch["response_mask"][:, 1:]
    return float(right.all(-1).float().mean())


def warm_start_threads(available: int) -> int:
    """Torch threads for a warm start: two at most (measured on an idle 2-core machine, the judge's warm start
    runs 1.3x faster on two than on one, same losses; tiny matrices gain nothing from more), one on a machine
    of one core or one whose cores are already busy (load average above the core count: two threads that wait
    on each other ran 20-40x slower there than one)."""
    cores = os.cpu_count() or 1
    busy = os.getloadavg()[0] > cores if hasattr(os, "getloadavg") else False
    return 1 if busy else min(2, available)


def warm_start(spec: ModelSpec, model: Any, tok: Any, *, stop: int | None = None) -> dict[str, Any]:
    """Train `model` in place for `spec.warm_start_steps` (or its first `stop` steps); returns a report
    (every step's loss, held-out accuracy)."""
    import torch

    rows = arithmetic_task(TASK_ROWS, seed=TASK_SEED + spec.seed)
    rng = random.Random(spec.seed)
    prompt_weight = 0.0 if spec.warm_start == "policy" else JUDGE_PROMPT_WEIGHT
    make = {
        "policy": lambda: policy_examples(tok, rows),
        "genrm": lambda: judge_examples(tok, rows, rng),
        "step_critique": lambda: critic_examples(tok, rows, rng),
    }[spec.warm_start]
    examples = make()
    held_out, train = examples[:128], examples[128:]
    threads = torch.get_num_threads()
    torch.set_num_threads(warm_start_threads(threads))
    torch.manual_seed(spec.seed)
    try:
        losses = sft_steps(
            model,
            train,
            tok.pad_token_id,
            steps=spec.warm_start_steps,
            lr=spec.warm_start_lr,
            batch_size=spec.warm_start_batch_size,
            seed=spec.seed,
            prompt_weight=prompt_weight,
            desc=f"warm start ({spec.warm_start})",
            stop=stop,
        )
    finally:
        torch.set_num_threads(threads)
    return {
        "kind": spec.warm_start,
        "steps": spec.warm_start_steps,
        "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / len(losses[-10:]),
        "held_out_accuracy": response_accuracy(model, held_out, tok.pad_token_id),
        "losses": losses,
    }
