"""`yatt config`: the full resolved config as YAML, with a one-line doc per key as a comment.

A key's doc is its field's comment in the config class's source (the trailing `# ...` on the field's line,
or the comment lines above it or above its group of fields; first sentence), else an entry of `FIELD_DOCS`
(class name.field name) for fields the source leaves uncommented; a key of fixed values (a `Literal` type)
also lists the values its doc does not name. A section's doc is the first sentence of its class docstring.
The printed YAML loads back as the same config (`yatt grpo --config printed.yaml`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
import types
import typing
from typing import Any, cast

import msgspec

# docs for fields whose source has no comment, by "Class.field"
FIELD_DOCS: dict[str, str] = {
    "RunConfig.app": "the job: grpo, dapo, ppo, capo, grpo-vlm, sft, or a job file's name (set by the job command)",
    "RunConfig.sampling": "the policy's sampling per prompt (n completions per prompt)",
    "RunConfig.rewards": "the reward terms, summed with their weights (kind: math_verify, regex, genrm, ...)",
    "RunSpec.name": "the run's name: the run directory is run.out_dir/NAME-TIME",
    "RunSpec.out_dir": "where run directories are created (relative: to the working directory)",
    "RunSpec.num_steps": "training steps in the run",
    "RunSpec.prompts_per_step": "prompts per step over all controllers (each gets sampling.n completions)",
    "RunSpec.seed": "seeds data order, sampling and model init",
    "RunSpec.progress": "show the progress bar",
    "ModelSpec.path": "an HF model folder or hub id; empty: a tiny model built from the fields below",
    "ModelSpec.hidden_size": "tiny model (path empty): hidden size",
    "ModelSpec.num_layers": "tiny model: decoder layers",
    "ModelSpec.num_heads": "tiny model: attention heads",
    "ModelSpec.num_kv_heads": "tiny model: key/value heads",
    "ModelSpec.head_dim": "tiny model: size of one attention head",
    "ModelSpec.vocab_size": "tiny model: vocabulary of the tokenizer trained on the task's text",
    "ModelSpec.max_position_embeddings": "tiny model: longest sequence",
    "ModelSpec.seed": "tiny model: weight init seed",
    "ModelSpec.tensor_parallel": "tensor-parallel devices of one replica (the actor's spans tp x pipeline_parallel)",
    "ModelSpec.trust_remote_code": "allow the model folder's own Python code (HF trust_remote_code)",
    "DataSpec.train": "the training set: a .jsonl or .parquet file; empty: the embedded arithmetic task",
    "DataSpec.val": "the validation set (same format); empty: none, or the embedded task's split",
    "DataSpec.prompt_key": "the row field holding the prompt text",
    "DataSpec.answer_key": "the row field holding the reference answer",
    "DataSpec.image_key": "the row field holding image paths (VLM), relative to the data file",
    "DataSpec.num_val_rows": "embedded task only: validation rows",
    "DataSpec.max_prompt_tokens": "longest prompt in tokens (chat template included); longer rows are an error",
    "DataSpec.system_prompt": "a system message put before every prompt; empty: none",
    "PlacementConfig.mode": "colocated (all roles share devices), partial, disaggregated, or dynamic (starts as "
    "partial; the rollout/judge split is re-planned as the run goes)",
    "PlacementConfig.cluster": "the devices the job may use",
    "PlacementConfig.cpus_per_device": "Ray CPUs reserved per logical device; each hosted role's torch threads",
    "ClusterSpec.num_nodes": "nodes in the cluster",
    "ClusterSpec.devices_per_node": "accelerators (or logical devices on CPU) per node",
    "ClusterSpec.device_memory_gb": "memory of one device, for planning",
    "ClusterSpec.device_kind": "gpu, or cpu",
    "SamplingParams.n": "completions per prompt (the GRPO group size)",
    "SamplingParams.temperature": "sampling temperature (0: greedy)",
    "SamplingParams.top_p": "nucleus sampling threshold (1.0: off)",
    "SamplingParams.top_k": "top-k filter (0: off)",
    "SamplingParams.max_new_tokens": "longest response in tokens",
    "SamplingParams.stop_token_ids": "extra token ids that end a response",
    "SamplingParams.seed": "a fixed seed per request (None: drawn from the run's seed)",
    "SamplingParams.logprobs": "return the sampled tokens' logprobs",
    "SamplingParams.choices": "constrain each completion to exactly one of these strings (unset: free text)",
    "SamplingParams.allowed_token_ids": "constrain every sampled token to these ids (unset: any)",
    "AlgoConfig.adv_estimator": "advantage estimator",
    "AlgoConfig.policy_loss": "policy loss",
    "AlgoConfig.loss_agg_mode": "how token losses are averaged",
    "AlgoConfig.clip_ratio_low": "PPO clip range below 1",
    "AlgoConfig.clip_ratio_high": "PPO clip range above 1 (DAPO's clip-higher raises it)",
    "AlgoConfig.gamma": "discount (GAE)",
    "AlgoConfig.lam": "GAE lambda",
    "AlgoConfig.adv_eps": "added to the group std when normalizing advantages",
    "AlgoConfig.kl_estimator": "KL estimator (a trailing +: the named value with k2's gradient)",
    "AlgoConfig.entropy_coef": "entropy bonus coefficient",
    "AlgoConfig.num_updates_per_batch": "optimizer passes over each step's batch",
    "AlgoConfig.gspo_clip_ratio_high": "GSPO clip range above 1",
    "AlgoConfig.cispo_clip_ratio_high": "CISPO clip of the IS weight above 1",
    "AlgoConfig.rollout_is_mode": "mismatch correction: truncate or mask weights above the threshold",
    "AlgoConfig.rollout_is_threshold": "mismatch correction: the weight threshold",
    "AlgoConfig.kl_horizon": "adaptive KL: horizon in steps",
    "AlgoConfig.overlong_penalty_factor": "DAPO overlong shaping: the penalty at the maximum length",
    "OptimConfig.lr": "peak learning rate (AdamW)",
    "OptimConfig.weight_decay": "AdamW weight decay",
    "OptimConfig.betas": "AdamW betas",
    "OptimConfig.eps": "AdamW epsilon",
    "OptimConfig.num_warmup_steps": "linear warmup steps",
    "OptimConfig.num_training_steps": "length of the cosine schedule in optimizer steps",
    "OptimConfig.min_lr_ratio": "the cosine schedule ends at lr x this",
    "OptimConfig.clip_grad_norm": "gradient norm clip",
    "OptimConfig.micro_batch_size": "sequences per forward/backward",
    "LearnerConfig.gradient_checkpointing": "recompute activations in backward to save memory",
    "LearnerConfig.lora_alpha": "LoRA scale numerator (scale = alpha / rank)",
    "LearnerConfig.lora_dropout": "LoRA dropout",
    "LearnerConfig.lora_target_modules": "module names that get LoRA adapters",
    "ControllerSpec.mode": "parallel (one controller per trainer data-parallel rank) or single",
    "ControllerSpec.num_controllers": "parallel controllers (run.prompts_per_step must divide evenly)",
    "ControllerSpec.seed": "the controllers' RNG seed",
    "ControllerSpec.heartbeat_interval_s": "seconds between the driver's health checks",
    "ControllerSpec.hang_timeout_s": "seconds without progress before the run counts as hung",
    "ControllerSpec.on_failure": "restart (from the newest checkpoint) or fail",
    "ControllerSpec.max_restarts": "restarts before the run fails",
    "ControllerSpec.keep_checkpoints": "newest checkpoints kept on disk",
    "ControllerSpec.hosted": "parallel controllers live in their learner rank's process (false: own processes)",
    "JudgeSpec.template_name": "the judge's prompt template",
    "JudgeSpec.template_version": "the template's version",
    "JudgeSpec.num_samples": "judgements per response (K), aggregated",
    "JudgeSpec.temperature": "the judge's sampling temperature",
    "JudgeSpec.top_p": "the judge's nucleus threshold",
    "JudgeSpec.max_new_tokens": "longest judgement in tokens",
    "JudgeSpec.parser": "how a verdict is read from a judgement: yes_no, score or json",
    "JudgeSpec.aggregation": "how the K verdicts combine: mean or majority",
    "JudgeSpec.score_range": "the range of a parsed score",
    "JudgeSpec.on_parse_error": "an unparsable judgement: zero, drop, or fail (the step fails)",
    "JudgeSpec.on_timeout": "a judgement past timeout_s: zero, drop, or fail (the step fails)",
    "JudgeSpec.timeout_s": "seconds per judgement",
    "JudgeSpec.max_concurrency": "judgements in flight",
    "JudgeSpec.dedup": "judge identical (prompt, response) pairs once",
    "DynamicSamplingSpec.max_refill": "refill waves per step at most",
    "DynamicSamplingSpec.safety": "refill size margin (>= 1)",
    "DynamicSamplingSpec.ema_decay": "decay of the total/valid groups EMA",
    "DynamicSamplingSpec.max_expansion": "cap of the expansion factor",
    "DynamicSamplingSpec.max_buffer": "surplus valid prompts kept (0: 4 x prompts per controller)",
    "CapoSpec.voting": "how K critiques' wrong-step sets combine",
    "CapoSpec.w_whole": "weight of the verifier reward",
    "CapoSpec.w_process": "penalty per token in a wrong step",
    "CapoSpec.critic": "the step critic's judge settings",
    "CapoConfig.capo": "CAPO's credit assignment (yatt capo)",
    "DapoConfig.dynamic_sampling": "DAPO's dynamic sampling (yatt dapo)",
    "AlgoConfig.gspo_clip_ratio_low": "GSPO clip range below 1 (far tighter than PPO's)",
    "AlgoConfig.cispo_clip_ratio_low": "CISPO clip of the IS weight below 1 (1: no lower bound)",
    "AlgoConfig.rollout_is_level": "rollout/train mismatch correction: none, token or sequence weights",
    "AlgoConfig.kl_target": "adaptive KL-reward coefficient's target (0: kl_reward_coef fixed)",
    "AlgoConfig.loss_agg_max_len": "Dr.GRPO's constant normalizer (0: the batch's padded length)",
    "AlgoConfig.overlong_buffer_len": "DAPO overlong shaping: penalized tokens before the maximum length (0: off)",
    "RaySpec.address": "join this Ray cluster (auto, ray://host:10001, host:6379); empty: start a local Ray",
    "RolloutSpec.engine": "the policy's rollout engine: hf (transformers) or vllm",
    "RolloutSpec.max_turns": "turns per episode in a multi-turn environment",
    "LogSpec.wandb": "also log every step to Weights & Biases (needs yatt-apps[wandb])",
    "LogSpec.project": "the W&B project",
}


def _first_sentence(doc: str | None) -> str:
    text = " ".join((doc or "").split())
    head, dot, _ = text.partition(". ")
    return head + ("." if dot else "") if head else ""


@functools.cache
def source_docs(cls: type) -> dict[str, str]:
    """field name -> its doc from `cls`'s source ({} without source): the comment on its line, else the
    comment block above it or above the fields it is grouped with (no blank line between), first sentence."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(textwrap.dedent("".join(lines)))
    fields = {
        node.lineno - 1: node.target.id
        for node in cast(ast.ClassDef, tree.body[0]).body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    docs = {}
    for row, name in fields.items():
        _, hash_, comment = lines[row].partition("  # ")
        text = comment.strip() if hash_ else _block_above(lines, row, fields)
        text = re.sub(r"^Appended in [0-9.]+\. ", "", text)  # a wire-history note, not the key's doc
        if text:
            docs[name] = _first_sentence(text)
    return docs


def _block_above(lines: list[str], row: int, fields: dict[int, str]) -> str:
    """The comment block right above `row`, looking past the uncommented fields of the same group."""
    row -= 1
    while row >= 0 and row in fields and "  # " not in lines[row]:
        row -= 1
    block: list[str] = []
    while row >= 0 and lines[row].strip().startswith("#"):
        block.insert(0, lines[row].strip().lstrip("#").strip())
        row -= 1
    return " ".join(block)


def field_doc(cls: type, name: str) -> str:
    """The doc of field `name` of `cls`, from the class that declares it (a job's config inherits most); a
    field of a fixed set of values (a `Literal` type) always names every value: the ones its doc does not
    name are listed after it, so help cannot fall behind the type."""
    doc = ""
    for owner in cls.__mro__:
        doc = FIELD_DOCS.get(f"{owner.__name__}.{name}") or source_docs(owner).get(name, "")
        if doc:
            break
    values = literal_values(cls, name)
    if values and not names_every_value(doc, values):
        listed = f"one of: {', '.join(values)}"
        return f"{doc} ({listed})" if doc else listed
    return doc


@functools.cache
def literal_values(cls: type, name: str) -> tuple[str, ...]:
    """The allowed values of field `name` of `cls` when its type is a `Literal` (optional or not), in the
    type's order; () for any other type."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # an annotation that does not resolve: no values to name
        return ()
    return tuple(str(value) for value in _literals(hints.get(name)))


def _literals(tp: Any) -> list[Any]:
    if typing.get_origin(tp) is typing.Literal:
        return list(typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # Literal[...] | None
        return [value for arg in typing.get_args(tp) for value in _literals(arg)]
    return []


def names_every_value(doc: str, values: tuple[str, ...]) -> bool:
    """Whether `doc` names each of `values` as a whole word ("k1" is not named by "k1+", nor "fp16" by
    "bf16")."""
    words = {word.rstrip(".") for word in re.findall(r"[\w.+-]+", doc)}
    return all(value in words for value in values)


def _scalar(value: Any) -> str:
    """One YAML value on one line (flow style for lists and mappings)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=2**31, sort_keys=False).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def commented_yaml(config: msgspec.Struct, indent: int = 0) -> list[str]:
    """The YAML lines of `config`, every key followed by its doc as a comment."""
    pad, out = "  " * indent, []
    for field in msgspec.structs.fields(config):
        value, doc = getattr(config, field.name), field_doc(type(config), field.name)
        if value is msgspec.UNSET:  # an optional field left unset (e.g. sampling.choices): not written
            continue
        if isinstance(value, msgspec.Struct):
            section = _first_sentence(type(value).__doc__)
            out.append(f"{pad}{field.name}:" + (f"  # {doc or section}" if doc or section else ""))
            out += commented_yaml(value, indent + 1)
        else:
            line = f"{pad}{field.name}: {_scalar(msgspec.to_builtins(value))}"
            out.append(line + (f"  # {doc}" if doc else ""))
    return out


def undocumented(config: msgspec.Struct, prefix: str = "") -> list[str]:
    """Key paths of `config` that have no doc."""
    missing = []
    for field in msgspec.structs.fields(config):
        value, path = getattr(config, field.name), prefix + field.name
        section = isinstance(value, msgspec.Struct) and _first_sentence(type(value).__doc__)
        if not (field_doc(type(config), field.name) or section):
            missing.append(path)
        if isinstance(value, msgspec.Struct):
            missing += undocumented(value, path + ".")
    return missing
