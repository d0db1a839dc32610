"""What a new user meets first (issue 34): the last step is always evaluated, the driver's model saves and
loads print no transformers bars, every fixed-value config key's help names all its values, and the README's
command table is the CLI's command list."""

from __future__ import annotations

import contextlib
import functools
import pickle
import re
import typing
from pathlib import Path
from types import SimpleNamespace, UnionType
from typing import Any

import msgspec
import pytest
from yatt_apps.cli.keydocs import field_doc, names_every_value
from yatt_apps.config import ModelSpec, tiny_cpu
from yatt_apps.io.data import arithmetic_task
from yatt_apps.io.models import load_causal_lm, prepare_model, tiny_text_model, tokenizer_corpus
from yatt_apps.io.rundir import RunDir
from yatt_apps.runtime import step_metrics, warmstart
from yatt_apps.runtime.progress import StepLogger

README = Path(__file__).resolve().parents[2] / "README.md"
BARS = ("Loading weights", "Writing model shards")

# ---- the last step is evaluated -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_steps", "every", "steps"),
    [
        (30, 10, [0, 10, 20, 29]),
        (10, 10, [0, 9]),
        (11, 10, [0, 10]),  # the last step is on the schedule already: evaluated once
        (1, 10, [0]),
        (5, 1, [0, 1, 2, 3, 4]),
        (7, 3, [0, 3, 6]),
        (8, 3, [0, 3, 6, 7]),
        (30, 0, []),  # 0 disables validation entirely, the last step included
    ],
)
def test_the_eval_schedule_ends_with_the_last_step(num_steps, every, steps):
    assert step_metrics.eval_steps(num_steps, every) == steps


def test_maybe_evaluate_runs_on_the_schedule(monkeypatch):
    """The step functions' gate: `evaluate` runs (in an "eval" phase) at exactly the scheduled steps."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(step_metrics, "evaluate", lambda ctx, *_: {"val/total": float(ctx.step)})
    base = tiny_cpu()
    cfg = msgspec.structs.replace(base, run=msgspec.structs.replace(base.run, num_steps=30, eval_every=10))

    @contextlib.contextmanager
    def phase(name: str):
        calls.append((name, ctx.step))
        yield

    ctx = SimpleNamespace(step=0, phase=phase)
    got = {}
    for step in range(30):
        ctx.step = step
        if sums := step_metrics.maybe_evaluate(ctx, lambda: [], cfg, None):
            got[step] = sums["val/total"]
    assert got == {0: 0.0, 10: 10.0, 20: 20.0, 29: 29.0}
    assert calls == [("eval", 0), ("eval", 10), ("eval", 20), ("eval", 29)]
    assert step_metrics.maybe_evaluate(ctx, None, cfg, None) == {}  # no validation rows: nothing evaluated


def test_validation_verifies_answers_in_killable_workers(monkeypatch):
    """An answer that sends math_verify into an endless expansion counts as wrong and is named
    (`val/timeout`) after the deadline; the others are graded as usual. The generation is a test double
    (fixed completions); the verification is the real worker pool."""
    from yatt_apps.io.data import PromptRow

    rows = [PromptRow(prompt="1 + 2 =", answer="3"), PromptRow(prompt="2 + 2 =", answer="4")]
    rows.append(PromptRow(prompt="3 + 3 =", answer="6"))
    answers = ["3", r"\boxed{(x+1)^{100000}}", "7"]
    outs = [SimpleNamespace(request_id=f"eval-p{i}", token_ids=[i]) for i in range(3)]
    monkeypatch.setattr(step_metrics, "render_prompt", lambda tok, row, system: [0])
    monkeypatch.setattr(step_metrics, "generate", lambda *args: outs)
    monkeypatch.setattr(step_metrics, "VAL_TIMEOUT_S", 2.0)
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens: answers[ids[0]])
    ctx = SimpleNamespace(rank=0, world_size=1)
    sums = step_metrics.evaluate(ctx, lambda: rows, tiny_cpu(), tok)
    assert sums == {"val/correct": 1.0, "val/total": 3.0, "val/timeout": 1.0}

    # the process's grading processes serve every evaluation (no new interpreter each time), its killed
    # worker replaced; a run's ValidationSet builds its rows once, and a copy sent to another process carries
    # the row function alone
    pool = step_metrics.rule_pool()
    supervisor, restarts = pool._proc, pool.restarts
    val = step_metrics.ValidationSet(functools.partial(list, rows))
    assert [step_metrics.evaluate(ctx, val, tiny_cpu(), tok) for _ in range(2)] == [sums, sums]
    assert step_metrics.rule_pool() is pool and pool._proc is supervisor and supervisor.poll() is None
    assert pool.restarts == restarts + 2  # one kill per evaluation
    copy = pickle.loads(pickle.dumps(val))
    assert copy._cached is None and copy() == rows
    # a closed pool (an embedding program's cleanup) is replaced at the next use
    pool.close()
    assert step_metrics.rule_pool() is not pool and not step_metrics.rule_pool().closed


# ---- quiet output ---------------------------------------------------------------------------------------------


@pytest.fixture
def loud_transformers():
    """transformers' bars and log level as a fresh process has them (another test may have quieted this
    process), restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_on, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.enable_progress_bar()
    hf_logging.set_verbosity_warning()
    yield hf_logging
    (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()
    hf_logging.set_verbosity(level)


def test_a_host_starts_a_rule_worker_per_core_of_its_share(monkeypatch):
    """`rule_workers`: the cores this process may run on over the node's devices, 1 to 4 (four workers a host on
    the tiny job's two cores and two devices spent 30 ms of CPU a step grading, one 16)."""
    import os

    def workers(cores: int, devices: int) -> int:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
        cfg = tiny_cpu()
        cluster = msgspec.structs.replace(cfg.placement.cluster, devices_per_node=devices)
        placement = msgspec.structs.replace(cfg.placement, cluster=cluster)
        return step_metrics.rule_workers(msgspec.structs.replace(cfg, placement=placement))

    assert [workers(2, 2), workers(2, 1), workers(16, 8), workers(128, 8), workers(4, 8)] == [1, 2, 2, 4, 1]


def test_warm_start_and_model_loads_print_no_bars(tmp_path, monkeypatch, capfd, loud_transformers):
    """A warm start (build, train, save into the cache) and the load after it print no transformers bars but
    announce the warm start and show its steps; the same save and load with transformers' bars on print both
    bars, so the capture sees them."""
    from yatt_rollout.tiny import save_tiny

    monkeypatch.setenv("YATT_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tokenizer_corpus(arithmetic_task(64, seed=0))
    spec = ModelSpec(warm_start="policy", warm_start_steps=2, warm_start_batch_size=4)
    load_causal_lm(save_tiny(*tiny_text_model(spec, corpus), tmp_path / "loud"))
    loud = capfd.readouterr()
    assert [bar for bar in BARS if bar in loud.err + loud.out] == list(BARS)  # the control: bars on, seen

    out = prepare_model(spec, tmp_path / "run" / "policy", corpus)  # warm start: build, train, save
    load_causal_lm(out)
    quiet = capfd.readouterr()
    assert not loud_transformers.is_progress_bar_enabled()
    assert [bar for bar in BARS if bar in quiet.err + quiet.out] == []
    # the warm start says so, once, and shows its own bar of steps instead
    cached = tmp_path / "cache" / f"policy-{warmstart.cache_key(spec, corpus)}"
    lines = quiet.err.replace("\r", "\n").splitlines()
    assert lines.count(f"warm-starting the tiny policy model (2 steps; once, then cached in {cached})") == 1
    assert any(line.startswith("warm start (policy): 100%|") and " 2/2 " in line for line in lines), lines
    prepare_model(spec, tmp_path / "again" / "policy", corpus)  # from the cache: nothing to announce
    assert "warm" not in capfd.readouterr().err


def test_the_step_logger_quiets_the_drivers_loads(tmp_path, capfd, loud_transformers):
    """The run's logger is made before the driver exports `final/`: loads after it print no bars."""
    from yatt_rollout.tiny import save_tiny

    spec = ModelSpec()
    model_dir = save_tiny(
        *tiny_text_model(spec, tokenizer_corpus(arithmetic_task(16, seed=0))), tmp_path / "m"
    )
    capfd.readouterr()
    run = RunDir(tmp_path / "run", tensorboard=False)
    logger = StepLogger(run, num_steps=1, start_step=0, progress=False)
    load_causal_lm(model_dir)
    logger.close()
    run.close(plot=False)
    quiet = capfd.readouterr()
    assert [bar for bar in BARS if bar in quiet.err + quiet.out] == []


# ---- help and docs agree ------------------------------------------------------------------------------------


def _literal_values(tp: Any) -> list[str]:
    if typing.get_origin(tp) is typing.Literal:
        return [str(v) for v in typing.get_args(tp)]
    if typing.get_origin(tp) in (typing.Union, UnionType):
        return [v for arg in typing.get_args(tp) for v in _literal_values(arg)]
    return []


def _structs(tp: Any) -> list[type]:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return [tp]
    return [s for arg in typing.get_args(tp) for s in _structs(arg)]


def literal_keys() -> dict[str, tuple[type, str, list[str]]]:
    """ "Class.field" -> (class, field, allowed values) for every Literal-typed field reachable from any
    registered job's config class."""
    from yatt_apps.jobs import registry

    found, seen = {}, set()
    todo: list[type] = [job.config for job in registry().values()]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for field in msgspec.structs.fields(cls):
            todo += _structs(hints[field.name])
            if values := _literal_values(hints[field.name]):
                found[f"{cls.__name__}.{field.name}"] = (cls, field.name, values)
    return found


def test_every_fixed_value_key_names_all_its_values():
    keys = literal_keys()
    assert {"PlacementConfig.mode", "AlgoConfig.kl_estimator", "CapoSpec.voting", "ModelSpec.dtype"} <= set(
        keys
    )
    missing = {}
    for name, (cls, field, values) in keys.items():
        doc = field_doc(cls, field)
        words = {w.rstrip(".") for w in re.split(r"[\s,;:()\[\]\"'`/]+", doc)}
        if absent := [v for v in values if v not in words]:
            missing[name] = (doc, absent)
    assert missing == {}


def test_key_docs_name_the_values_exactly():
    keys = literal_keys()
    placement, capo, estimator = (
        keys[k][0] for k in ("PlacementConfig.mode", "CapoSpec.voting", "AlgoConfig.kl_estimator")
    )
    assert field_doc(placement, "mode") == (
        "colocated (all roles share devices), partial, disaggregated, or dynamic (starts as partial; the "
        "rollout/judge split is re-planned as the run goes)"
    )
    # a doc that does not name the values gets them listed, in the type's order
    assert field_doc(capo, "voting") == (
        "how K critiques' wrong-step sets combine (one of: intersection, majority, union, average)"
    )
    assert field_doc(estimator, "kl_estimator") == (
        "KL estimator (a trailing +: the named value with k2's gradient) "
        "(one of: k1, k2, k3, abs, k1+, k3+, abs+, low_var_kl, low_var_kl+)"
    )
    assert names_every_value("bf16 or fp32", ("fp16",)) is False  # whole words only
    assert names_every_value("k1+ or k3+", ("k1",)) is False
    assert names_every_value("zero, drop, or fail.", ("zero", "drop", "fail")) is True


def readme_table(after: str, pattern: str) -> list[str]:
    """The first column's names (by `pattern`) of the first table after the line `after` in README.md."""
    section = README.read_text().split(after, 1)[1]
    table = next(block for block in section.split("\n\n") if block.strip().startswith("|"))
    return re.findall(pattern, table, flags=re.M)


def readme_commands() -> list[str]:
    """The subcommands in the README's command table (the section "The `yatt` command"), in its order."""
    return readme_table("### The `yatt` command", r"^\| `yatt ([a-z][\w-]*)")


def test_the_readme_command_table_is_the_cli():
    """Every job of the registry (`yatt sft`, `yatt run` for a job file) and every plain command has a row,
    and no row names a command the CLI lacks."""
    from yatt_apps.cli.main import commands
    from yatt_apps.jobs import registry

    rows = readme_commands()
    assert len(rows) == len(set(rows)), rows  # one row per command
    assert set(registry()) <= set(rows)
    assert {"sft", "run"} <= set(rows)
    assert sorted(rows) == sorted(commands())


def test_the_readme_preset_table_is_the_presets():
    from yatt_apps.jobs import presets

    rows = readme_table("### Presets", r"^\| `(\w+)` \|")
    assert sorted(rows) == sorted(presets())  # config.PRESETS and every job's own default
    assert "tiny_cpu_sft" in rows  # `yatt sft`'s default


def test_pasted_commands_say_uv_run_where_yatt_ran_under_uv(monkeypatch):
    """Messages print the command the user can paste: `uv run yatt ...` after the README's `uv sync` (the
    process was started by `uv run`), `yatt ...` from an activated environment."""
    from yatt_apps.runtime.interrupt import interrupted_message
    from yatt_apps.runtime.progress import yatt_command

    monkeypatch.setenv("UV_RUN_RECURSION_DEPTH", "1")
    assert yatt_command() == "uv run yatt"
    assert "resume with: uv run yatt resume /no/run" in interrupted_message("/no/run")
    monkeypatch.delenv("UV_RUN_RECURSION_DEPTH")
    assert yatt_command() == "yatt"
    assert "resume with: yatt resume /no/run" in interrupted_message("/no/run")
