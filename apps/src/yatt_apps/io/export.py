"""`yatt export`: a trained policy out of a run as an HF model folder, without Ray.

A run's `models/policy` is the initial model; the trained weights live in its checkpoints: a torch learner's
sharded checkpoint (`checkpoints/step-N/learner/`: DCP's `.metadata` and one `__R_0.distcp` per rank, see
`yatt_algos.learner.sharded`), or, written by earlier releases, the learner blob
(`checkpoints/step-N/learner-<dp>.<tp>.bin`, a `torch.save`d learner state). `export_checkpoint` verifies a
complete checkpoint against its manifest, rebuilds the policy from its initial folder (config, with the run's
LoRA adapters when the learner used LoRA), loads the learner's model weights (from a sharded checkpoint a
bucket at a time, straight into the model: the weights are never held twice, whatever the world size that
wrote them), and writes an HF folder with `save_hf`: config, safetensors weights, tokenizer and chat template
(and the image processor of a VLM), LoRA merged into the base weights. `yatt merge` and
`AutoModelForCausalLM.from_pretrained` read it like any HF folder.

A text-to-image run (`yatt grpo-t2i`, `app: grpo-t2i` in its config.yaml) exports as a diffusers folder
instead (`export_t2i`): the run's initial pipeline (`t2i.path`, RUN_DIR/models/t2i for the tiny one) with the
checkpoint's transformer weights, written by yatt-rollout's `save_t2i`: the folder the run writes to
RUN_DIR/final at its last step, from any checkpoint.

`save_hf` is also what a run uses to write `RUN_DIR/final` from the live learner at the end.

`--adapter` (a LoRA run only) writes the adapter alone, in peft's format (`adapter_config.json`,
`adapter_model.safetensors`, peft's own `save_pretrained`): `peft.PeftModel.from_pretrained(base, OUT)` over
the run's initial policy folder gives the trained policy, and vLLM serves it as a LoRA adapter.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from yatt_apps.config import RunConfig


# the blob of data-parallel rank 0, tensor-parallel rank 0: every DP rank holds the full model (DDP, and
# FSDP2's full state dict), so one rank's file restores it
LEARNER_BLOB = "learner-0.0.bin"
LEARNER_SHARDS = "learner"  # a sharded (DCP) learner checkpoint's folder
BUCKET_BYTES = 256 << 20  # what a sharded checkpoint's export reads at a time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory written by a job command")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the newest complete one)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the HF folder to write (must not exist)")
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: write the adapter alone in peft's format (adapter_config.json, adapter_model"
        ".safetensors) instead of merged weights",
    )


def _plain_model(model: Any) -> tuple[Any, dict[str, Any] | None]:
    """(the HF model to call save_pretrained on, the state dict to save or None for its own): a DDP wrapper
    is removed; a peft model saves its base model with the adapters merged out of place (W + s B A), so a
    live learner's weights are not touched; FSDP2 shards are gathered into full tensors (a collective)."""
    from yatt_algos.learner.export import hf_named_tensors, unwrap

    model = unwrap(model)
    peft = hasattr(model, "peft_config")
    sharded = any(hasattr(param, "full_tensor") for param in model.parameters())
    if not (peft or sharded):
        return model, None
    state = {name: tensor.contiguous() for name, tensor in hf_named_tensors(model)}
    return (model.get_base_model() if peft else model), state


def save_hf(model: Any, tokenizer_dir: str | Path, out_dir: str | Path, *, write: bool = True) -> Path:
    """Write `model` (an HF model, possibly DDP-wrapped, FSDP2-sharded or a peft LoRA model) as an HF folder
    at `out_dir`, with the tokenizer (chat template included) and, for a VLM, the image processor of
    `tokenizer_dir`.

    Atomic: written to `OUT.tmp` and renamed; an existing `out_dir` is replaced only after the new folder is
    complete. Under FSDP2 every rank must call this together (the full weights are gathered), with
    `write=False` on all ranks but one."""
    from yatt_apps.io.models import is_vlm, load_image_processor, load_tokenizer

    out = Path(out_dir)
    if not write:
        _plain_model(model)  # take part in the gather only
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # an earlier export that died half-way
    try:
        base, state = _plain_model(model)
        base.save_pretrained(tmp, state_dict=state)
        try:
            tokenizer = load_tokenizer(tokenizer_dir)
        except OSError as err:
            raise ValueError(f"no tokenizer at {tokenizer_dir}: {err}") from None
        tokenizer.save_pretrained(tmp)
        if is_vlm(tokenizer_dir):
            load_image_processor(tokenizer_dir).save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.with_name(out.name + ".old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def find_checkpoint(run_dir: Path, step: int | None) -> tuple[Path, int]:
    """(the verified checkpoint directory, its step): the newest complete one, or step `step`."""
    from yatt_controller import checkpoint

    root = run_dir / "checkpoints"
    steps = checkpoint.complete_steps(root)
    if step is None:
        found = checkpoint.latest(root)
        if found is None:
            raise ValueError(
                f"{run_dir}: no complete checkpoint in {root} (a run writes one every "
                "controller.checkpoint_every steps)"
            )
        return found[0], found[1].step
    path = root / f"step-{step:08d}"
    if step not in steps:
        raise ValueError(f"{run_dir}: --step {step}: no checkpoint of that step; complete steps: {steps}")
    return path, checkpoint.verify(path).step


def load_policy(run_dir: Path, ckpt: Path) -> Any:
    """The run's policy with the checkpoint's learner weights loaded (LoRA adapters attached, not merged)."""
    import torch
    from yatt_algos.learner.checkpoint import check_learner_state
    from yatt_algos.learner.torch_engine import apply_lora

    from yatt_apps.io.models import load_causal_lm

    cfg = run_config(run_dir)
    if (ckpt / LEARNER_SHARDS / ".metadata").is_file():
        return _policy_from_shards(run_dir, cfg, ckpt / LEARNER_SHARDS)
    blob = ckpt / LEARNER_BLOB
    if not blob.is_file():
        raise ValueError(f"{ckpt}: no {LEARNER_BLOB} (the learner's state); files: {sorted(_names(ckpt))}")
    from yatt_apps.runtime.workers import learner_backend

    # a DDP replica over k devices (model.tensor_parallel = k for a vLLM rollout) holds k whole copies
    sharded = learner_backend(cfg) != "ddp"
    if sharded and any(name.startswith("learner-0.") and name != LEARNER_BLOB for name in _names(ckpt)):
        raise ValueError(f"{ckpt}: a tensor-parallel learner checkpoint; export reads unsharded ones only")
    state = torch.load(blob, map_location="cpu", weights_only=True)
    check_learner_state(state)
    model = apply_lora(
        load_causal_lm(policy_dir(run_dir, cfg), trust_remote_code=cfg.model.trust_remote_code), cfg.learner
    )
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise ValueError(f"{blob}: the learner's weights do not fit the run's policy model: {err}") from None
    return model.eval()


def _policy_from_shards(run_dir: Path, cfg: RunConfig, shards: Path) -> Any:
    """The run's policy (LoRA adapters attached) with a sharded checkpoint's model weights copied in a bucket at
    a time (`sharded.iter_checkpoint_tensors`): the model is the only whole copy."""
    import torch
    from yatt_algos.learner.sharded import iter_checkpoint_tensors
    from yatt_algos.learner.torch_engine import apply_lora

    from yatt_apps.io.models import load_causal_lm

    model = apply_lora(
        load_causal_lm(policy_dir(run_dir, cfg), trust_remote_code=cfg.model.trust_remote_code), cfg.learner
    )
    target, written = model.state_dict(), set()
    with torch.no_grad():
        for bucket in iter_checkpoint_tensors(shards, BUCKET_BYTES):
            for name, tensor in bucket:
                if name not in target or target[name].shape != tensor.shape:
                    raise ValueError(
                        f"{shards}: the learner's {name} {tuple(tensor.shape)} does not fit the run's policy "
                        f"model ({tuple(target[name].shape) if name in target else 'no such tensor'})"
                    )
                target[name].copy_(tensor)
                written.add(target[name].data_ptr())
    missing = sorted(name for name, t in target.items() if t.data_ptr() not in written)  # tied ones share
    if missing:
        raise ValueError(
            f"{shards}: the checkpoint lacks the policy's {missing[:5]} ({len(missing)} tensors)"
        )
    return model.eval()


def _names(path: Path) -> list[str]:
    return [p.name for p in path.iterdir()]


def run_config(run_dir: Path) -> RunConfig:
    """The run's saved config as its job's config class (a shipped job's, by `app`); a job of a user's own
    file is read as the shared `RunConfig` keys (what export needs: the model, the learner's LoRA)."""
    import msgspec

    from yatt_apps.config import RunConfig
    from yatt_apps.jobs import registry
    from yatt_apps.overlay import read_yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.yaml)")
    doc = read_yaml(path)
    job = registry().get(str(doc.get("app", "")))
    cls = job.config if job is not None else RunConfig
    shared = {k: v for k, v in doc.items() if k in cls.__struct_fields__}
    try:
        return msgspec.convert(shared, cls, strict=False)
    except msgspec.ValidationError as err:
        raise ValueError(f"invalid config (from {path}): {err}") from None


def policy_dir(run_dir: Path, cfg: RunConfig) -> Path:
    """The policy's initial HF folder: the user's `model.path`, or the tiny model built into the run."""
    return Path(cfg.model.path) if cfg.model.path else run_dir / "models" / "policy"


def export_checkpoint(
    run_dir: str | Path, step: int | None, out: str | Path, *, adapter: bool = False
) -> dict[str, Any]:
    """Export the checkpoint of `step` (None: the newest complete one) of `run_dir` as an HF folder `out`
    (`adapter`: a LoRA run's adapter alone, peft's format); returns a record of what was written."""
    run_dir, out = Path(run_dir), Path(out)
    if out.exists():
        raise ValueError(f"--out {out} already exists; choose a new directory")
    if run_config(run_dir).app == T2I_APP:
        if adapter:
            raise ValueError(f"--adapter: {run_dir} is a text-to-image run (no LoRA); export it without")
        return export_t2i(run_dir, step, out)
    if adapter and not run_config(run_dir).learner.lora_rank:
        raise ValueError(f"--adapter: {run_dir} is not a LoRA run (learner.lora_rank = 0); export it without")
    ckpt, found = find_checkpoint(run_dir, step)
    model = load_policy(run_dir, ckpt)
    record = {"out": str(out), "step": found, "checkpoint": str(ckpt)}
    if adapter:
        save_adapter(model, out)
        return {**record, "adapter": True, "lora_merged": False}
    save_hf(model, policy_dir(run_dir, run_config(run_dir)), out)
    return {**record, "lora_merged": hasattr(model, "peft_config")}


T2I_APP = "grpo-t2i"  # a run of this app exports as a diffusers folder


def t2i_pipeline_dir(run_dir: Path, cfg: Any) -> Path:
    """The t2i run's initial pipeline folder: `t2i.path` as the run recorded it, or RUN_DIR/models/t2i (the
    tiny pipeline's place) when the run folder was moved since."""
    recorded = Path(cfg.t2i.path) if cfg.t2i.path else run_dir / "models" / "t2i"
    if (recorded / "model_index.json").is_file():
        return recorded
    inside = run_dir / "models" / "t2i"
    if (inside / "model_index.json").is_file():
        return inside
    raise ValueError(
        f"{run_dir}: the run's pipeline folder {recorded} (t2i.path) is not a diffusers folder (no model_index.json)"
    )


def export_t2i(run_dir: Path, step: int | None, out: Path) -> dict[str, Any]:
    """A t2i run's checkpoint of `step` (None: the newest complete one) as a diffusers folder `out`: the
    run's pipeline with the learner's transformer weights (data-parallel rank 0's blob: every rank holds
    them whole), written atomically by `save_t2i`."""
    import torch
    from yatt_algos.learner.checkpoint import check_learner_state
    from yatt_rollout.diffusion_models import load_t2i, save_t2i

    pipeline = t2i_pipeline_dir(run_dir, run_config(run_dir))
    ckpt, found = find_checkpoint(run_dir, step)
    blob = ckpt / LEARNER_BLOB
    if not blob.is_file():
        raise ValueError(f"{ckpt}: no {LEARNER_BLOB} (the learner's state); files: {sorted(_names(ckpt))}")
    state = torch.load(blob, map_location="cpu", weights_only=True)
    check_learner_state(state)
    policy = load_t2i(pipeline)
    try:
        policy.transformer.load_state_dict(state["model"])
    except RuntimeError as err:
        raise ValueError(
            f"{blob}: the learner's weights do not fit the run's pipeline {pipeline}: {err}"
        ) from None
    save_t2i(policy, out)
    return {"out": str(out), "step": found, "checkpoint": str(ckpt), "format": "diffusers"}


def save_adapter(model: Any, out: Path) -> Path:
    """A peft model's adapter as peft's folder at `out` (written to `OUT.tmp`, then renamed)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.rename(out)
    return out


def main(args: argparse.Namespace) -> int:
    record = export_checkpoint(args.run_dir, args.step, args.out, adapter=args.adapter)
    if not args.json:
        kind = " (a diffusers folder)" if record.get("format") == "diffusers" else ""
        print(f"exported step {record['step']} of {args.run_dir} to {record['out']}{kind}")
    print(json.dumps(record))
    return 0
