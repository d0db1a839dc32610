"""The agentic job's data and multi-turn SFT warm start (`yatt grpo` with `rollout.env`: the job's `prepare`).

An environment that draws its own rows (`rows(n, seed)`, as `yatt_rollout.tool_tasks`' do) supplies the
run's prompts when `data.train` is empty: they are written to `RUN_DIR/task/{train,val}.jsonl` and the run
reads them like a user's files. With `rollout.sft_steps > 0` and a tiny policy (`model.path` empty), the
policy is first fine-tuned on the environment's demonstrations (`demonstrations(rows, seed)`: TRL-format
conversations with tool calls, tool results and direct answers), laid out exactly as the episodes are
(`TurnCodec.conversation_ids`: the prompt with its tools, the model's turns, the environment's replies) with
the loss on the model's turns only, so RL starts from a policy that knows the format. The result is cached
like the other warm starts (`warmstart.cache_root()`, `agent-KEY`, written atomically) and the run uses it
as `model.path`. The `tiny_cpu_agent` preset's warm start is shipped in the package (`runtime.shipped`,
`agent-SHIPKEY`: SHIPKEY is KEY without the package versions) and copied into the cache instead of trained.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from yatt_apps.config import RunConfig

FORMAT_VERSION = 2  # bump when the data or training below changes: the cache key includes it
TASK_SEED = 30_000  # the demonstrations' rows, apart from the run's train (seed) and val (seed + 10_000)


def prepare(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """The config a multi-turn run uses: the environment's own rows as its data (if it has rows and no
    `data.train` is given) and the warm-started policy as `model.path` (with `rollout.sft_steps`)."""
    if not cfg.rollout.env:
        return cfg
    from yatt_rollout.env import ENVIRONMENTS

    from yatt_apps.runtime.agent import resolve_env

    factory = ENVIRONMENTS[resolve_env(cfg.rollout.env)]
    replace = msgspec.structs.replace
    if not cfg.data.train and hasattr(factory, "rows"):
        folder = run_dir / "task"
        folder.mkdir(parents=True, exist_ok=True)
        train = _write(folder / "train.jsonl", factory.rows(cfg.data.num_train_rows, cfg.run.seed))
        val = _write(folder / "val.jsonl", factory.rows(cfg.data.num_val_rows, cfg.run.seed + 10_000))
        cfg = replace(cfg, data=replace(cfg.data, train=str(train), val=str(val)))
    if cfg.rollout.sft_steps and not cfg.model.path:
        if not hasattr(factory, "demonstrations"):
            raise ValueError(
                f"rollout.sft_steps={cfg.rollout.sft_steps}: environment {cfg.rollout.env!r} has no "
                "demonstrations(rows, seed) to warm-start from"
            )
        path = warm_started(cfg, factory)
        cfg = replace(cfg, model=replace(cfg.model, path=str(path), warm_start="none", warm_start_steps=0))
    return cfg


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)
    return path


def demonstrations(cfg: RunConfig, factory: Any) -> list[dict[str, Any]]:
    rows = factory.rows(cfg.rollout.sft_demos, TASK_SEED + cfg.model.seed)
    return factory.demonstrations(rows, TASK_SEED + cfg.model.seed)


def corpus(demos: list[dict[str, Any]], tok: Any) -> list[str]:
    """The tokenizer's text: every demonstration as the chat template renders it (tools included)."""
    return [tok.apply_chat_template(d["messages"], tools=d["tools"], tokenize=False) for d in demos]


def _recipe(cfg: RunConfig) -> list[Any]:
    """What the warm-started weights depend on, apart from the package versions."""
    from yatt_apps.runtime.warmstart import SERVING_FIELDS

    shaping = {k: v for k, v in msgspec.to_builtins(cfg.model).items() if k not in SERVING_FIELDS}
    spec = [cfg.rollout.env, cfg.rollout.sft_steps, cfg.rollout.sft_demos, FORMAT_VERSION, TASK_SEED]
    return [shaping, spec]


def cache_key(cfg: RunConfig) -> str:
    """The cache folder's key: the recipe and the package versions."""
    from importlib.metadata import version

    versions = [version(p) for p in ("yatt-apps", "yatt-rollout", "transformers", "torch")]
    return hashlib.sha256(msgspec.json.encode([*_recipe(cfg), versions])).hexdigest()[:16]


def ship_key(cfg: RunConfig) -> str:
    """The shipped folder's key (`shipped.find_agent`): the recipe only, so a release that leaves it alone
    keeps the shipped warm start."""
    return hashlib.sha256(msgspec.json.encode(_recipe(cfg))).hexdigest()[:16]


def warm_started(cfg: RunConfig, factory: Any) -> Path:
    """The cached warm-started policy folder: copied from the package's shipped one when its recipe matches
    (unless YATT_NO_SHIPPED is set), else built (tokenizer, model, SFT) the first time."""
    import os
    import shutil

    from yatt_apps.runtime import shipped
    from yatt_apps.runtime.warmstart import cache_root, store, store_model

    cached = cache_root() / f"agent-{cache_key(cfg)}"
    source = None if os.environ.get("YATT_NO_SHIPPED") else shipped.find_agent(cfg)
    if source is not None and not (cached / "config.json").is_file():  # the package's own copy: no training
        store(cached, lambda tmp: shutil.copytree(source, tmp))
    if (cached / "config.json").is_file():
        return cached
    print(
        f"warm-starting the tiny policy on {cfg.rollout.env!r} demonstrations ({cfg.rollout.sft_steps} steps; "
        f"once, then cached in {cached})",
        file=sys.stderr,
        flush=True,
    )
    model, tok, report = build(cfg, factory)
    report["kind"], report["ship_key"] = "agent", ship_key(cfg)  # its name if shipped (`shipped.rebuild`)
    store_model(cached, model, tok, report)  # atomic; a concurrent run's own folder never collides with ours
    return cached


def build(cfg: RunConfig, factory: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, report) of the tiny policy after `rollout.sft_steps` steps on the demonstrations."""
    import torch

    model, tok, examples = fresh(cfg, factory)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses = sft(model, examples, tok.pad_token_id, cfg)
    finally:
        torch.set_num_threads(threads)
    longest = max(len(ids) for ids, _ in examples)
    return model, tok, {"steps": cfg.rollout.sft_steps, "losses": losses, "longest_example": longest}


def fresh(cfg: RunConfig, factory: Any) -> tuple[Any, Any, list[tuple[list[int], list[int]]]]:
    """(model, tokenizer, examples) before the SFT: a tokenizer trained on the demonstrations as the chat
    template renders them, a fresh tiny model, and each demonstration's (ids, loss mask)."""
    from yatt_rollout.tiny import train_tokenizer

    from yatt_apps.io.models import tiny_text_model
    from yatt_apps.io.sft_data import encode_conversation

    demos = demonstrations(cfg, factory)
    text = corpus(demos, train_tokenizer(["x"], vocab_size=300))  # the template needs no trained vocab
    model, tok = tiny_text_model(cfg.model, text)
    return model, tok, [encode_conversation(tok, d["messages"], d["tools"]) for d in demos]


def sft(
    model: Any,
    examples: list[tuple[list[int], list[int]]],
    pad_id: int,
    cfg: RunConfig,
    stop: int | None = None,
) -> list[float]:
    """Plain-torch SFT of the model's turns (`warmstart.sft_steps` on (ids, loss mask) pairs): AdamW at
    `model.warm_start_lr`, warmup over the first tenth, `model.warm_start_batch_size` examples a step,
    clipping at 1.0. `stop`: only the first `stop` steps of that schedule (`test_shipped`'s check)."""
    import torch

    from yatt_apps.io.sft_data import pad_masked
    from yatt_apps.runtime.warmstart import sft_steps

    torch.manual_seed(cfg.model.seed)
    return sft_steps(
        model,
        examples,
        pad_id,
        steps=cfg.rollout.sft_steps,
        lr=cfg.model.warm_start_lr,
        batch_size=cfg.model.warm_start_batch_size,
        seed=cfg.model.seed,
        desc="warm start (agent)" if stop is None else "",
        stop=stop,
        pad=pad_masked,
    )
