"""`yatt merge`: Bone Soup (arXiv 2502.10762) over saved backbones, into a new HF model directory.

Backbone k was trained on h_k = sum_j B_kj r_j with B = B(n, beta) (beta on the diagonal, (1 - beta)/(n - 1)
elsewhere). For a user preference mu on the simplex the merge solves B^T lambda = mu and writes
theta = sum_k lambda_k theta_k (lambda sums to 1 and may be negative); with an SFT model theta_0 and
extrapolation alphas, each backbone is first pushed away from theta_0 by k = 1 / (1 - a), as in
`yatt_algos.bone_soup.bone_soup_merge`. The arithmetic is yatt_algos' (`merge_state_dicts`: fp32
accumulation, cast back to each tensor's dtype); this module adds the files:

- inputs are HF directories with safetensors weights (one file or an index of shards); their config.json must
  agree (up to bookkeeping keys) and their tensors must have the same names and shapes, checked from the file
  headers before any tensor is read;
- the merge streams shard by shard in the first backbone's layout, so memory holds one output shard and one
  tensor per input, not n whole models;
- the output (weights, the first backbone's config and tokenizer files, and `bone_soup.json` with lambda) is
  written to a temporary folder and renamed into place: a half-written merge is never a model directory.

The command prints one JSON line with lambda and the coefficients applied to each input.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
# config.json keys that record how a model was saved, not what it is
BOOKKEEPING_KEYS = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype"})
RECORD = "bone_soup.json"
# weights in any format are never copied from the template directory: the merge writes its own
OTHER_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".bin.index.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backbones",
        nargs="+",
        required=True,
        metavar="DIR",
        help="the n backbone HF directories, in the order of B's rows",
    )
    parser.add_argument("--beta", type=float, required=True, help="B's diagonal (the paper uses 0.6-0.8)")
    parser.add_argument(
        "--preference",
        nargs="+",
        type=float,
        required=True,
        metavar="MU",
        help="the user's weights over the n objectives, on the simplex (e.g. 0.2 0.8)",
    )
    parser.add_argument("--sft", metavar="DIR", help="the SFT model the backbones started from")
    parser.add_argument(
        "--alpha",
        nargs="+",
        type=float,
        metavar="A",
        help="extrapolation away from --sft, k = 1/(1 - a): one value or one per backbone",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="the merged HF directory (must not exist)"
    )


# ---- reading and checking the inputs ---------------------------------------------------------------------


def weight_map(path: Path, label: str) -> dict[str, Path]:
    """tensor name -> the safetensors file that holds it, for the HF directory `path`."""
    if not (path / "config.json").is_file():
        raise ValueError(f"{label} {path}: not an HF model directory (no config.json)")
    if (path / INDEX).is_file():
        try:
            index = json.loads((path / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{label} {path / INDEX}: not a safetensors index ({err})") from None
        missing = sorted({file for file in index.values() if not (path / file).is_file()})
        if missing:
            raise ValueError(f"{label} {path / INDEX}: lists shard(s) that are not there: {missing[:3]}")
        return {name: path / file for name, file in index.items()}
    if (path / WEIGHTS).is_file():
        return dict.fromkeys(tensor_specs({"": path / WEIGHTS}, label), path / WEIGHTS)
    raise ValueError(f"{label} {path}: no {WEIGHTS} or {INDEX} (save with safetensors)")


def model_config(path: Path, label: str) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{label} {path / 'config.json'}: not valid JSON ({err})") from None
    return {k: v for k, v in config.items() if k not in BOOKKEEPING_KEYS}


def tensor_specs(files: dict[str, Path], label: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape), read from the safetensors headers only."""
    from safetensors import safe_open

    specs = {}
    for file in sorted(set(files.values())):
        try:
            with safe_open(file, "pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    sliced = f.get_slice(name)
                    specs[name] = (sliced.get_dtype(), tuple(sliced.get_shape()))
        except Exception as err:  # safetensors raises its own error type for a bad header
            raise ValueError(f"{label} {file}: not a readable safetensors file ({err})") from None
    return specs


def check_compatible(inputs: list[tuple[str, Path]]) -> list[dict[str, Path]]:
    """The weight maps of `inputs` ((label, dir) pairs), after checking every config and tensor against the
    first input's; errors name the argument, the file and the first differences."""
    (label0, path0), maps = inputs[0], [weight_map(p, label) for label, p in inputs]
    config0, specs0 = model_config(path0, label0), tensor_specs(maps[0], label0)
    for (label, path), files in zip(inputs[1:], maps[1:], strict=True):
        config = model_config(path, label)
        differ = sorted(k for k in config0.keys() | config.keys() if config0.get(k) != config.get(k))
        if differ:
            shown = ", ".join(f"{k} {config.get(k)!r} vs {config0.get(k)!r}" for k in differ[:3])
            raise ValueError(
                f"{label} {path / 'config.json'}: architecture differs from {label0} {path0}: {shown}"
            )
        specs = tensor_specs(files, label)
        missing, extra = sorted(specs0.keys() - specs.keys()), sorted(specs.keys() - specs0.keys())
        if missing or extra:
            raise ValueError(
                f"{label} {path}: tensor names differ from {label0} {path0}: missing {missing[:3]}, "
                f"extra {extra[:3]}"
            )
        for name, spec in specs0.items():
            if specs[name] != spec:
                raise ValueError(f"{label} {files[name]}: tensor {name} is {specs[name]}, expected {spec}")
    return maps


# ---- coefficients ----------------------------------------------------------------------------------------


def soup_coefficients(
    num_backbones: int, preference: list[float], beta: float, *, sft: bool, alphas: list[float] | None
) -> tuple[list[float], list[float]]:
    """(lambda [n], coefficients of the inputs): without an SFT model the coefficients are lambda; with one
    they are [1 - sum_k lambda_k k_k, lambda_1 k_1, ...] over (theta_0, theta_1, ...), the same combination
    as `bone_soup_merge`. Errors name the command-line argument."""
    from yatt_algos.bone_soup import backbone_matrix, extrapolation_factor, merge_coefficients

    if len(preference) != num_backbones:
        raise ValueError(f"--preference has {len(preference)} values for {num_backbones} --backbones")
    if alphas is not None and not sft:
        raise ValueError("--alpha needs --sft: extrapolation is away from the SFT model")
    try:
        matrix = backbone_matrix(num_backbones, beta)
    except ValueError as err:
        raise ValueError(f"--beta: {err}") from None
    try:
        lam = merge_coefficients(matrix, preference).tolist()
    except ValueError as err:
        raise ValueError(f"--preference: {err}") from None
    if not sft:
        return lam, lam
    alphas = [0.0] if alphas is None else alphas
    if len(alphas) not in (1, num_backbones):
        raise ValueError(f"--alpha has {len(alphas)} values: give one, or one per backbone ({num_backbones})")
    try:
        factors = [extrapolation_factor(a) for a in alphas * (num_backbones // len(alphas))]
    except ValueError as err:
        raise ValueError(f"--alpha: {err}") from None
    scaled = [lam_k * k for lam_k, k in zip(lam, factors, strict=True)]
    return lam, [1.0 - sum(scaled), *scaled]


# ---- the merge -------------------------------------------------------------------------------------------


def _merge_into(maps: list[dict[str, Path]], coefs: list[float], out: Path) -> int:
    """Write sum_i coefs[i] * input_i shard by shard in the first input's layout; returns the tensor count."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from yatt_algos.bone_soup import merge_state_dicts

    layout: dict[Path, list[str]] = {}
    for name, file in maps[0].items():
        layout.setdefault(file, []).append(name)
    for file, names in layout.items():
        sources = []
        for files in maps:  # this input's tensors for the shard, read file by file
            tensors = {}
            for src in sorted({files[n] for n in names}):
                with safe_open(src, "pt") as f:
                    tensors.update({n: f.get_tensor(n) for n in names if files[n] == src})
            sources.append(tensors)
        save_file(merge_state_dicts(sources, coefs), out / file.name, metadata={"format": "pt"})
    return len(maps[0])


def merge_directories(
    backbones: list[str | Path],
    out: str | Path,
    *,
    beta: float,
    preference: list[float],
    sft: str | Path | None = None,
    alphas: list[float] | None = None,
) -> dict[str, Any]:
    """Merge the backbone directories into `out` for `preference`; returns the record written beside the
    weights (lambda, the coefficients per input, the inputs)."""
    if len(backbones) < 2:
        raise ValueError(f"--backbones needs at least 2 directories, got {len(backbones)}")
    out = Path(out)
    if out.exists():
        raise ValueError(f"--out {out} already exists; choose a new directory")
    lam, coefs = soup_coefficients(len(backbones), preference, beta, sft=sft is not None, alphas=alphas)
    inputs = [(f"--backbones[{k}]", Path(p)) for k, p in enumerate(backbones)]
    if sft is not None:
        inputs.insert(0, ("--sft", Path(sft)))
    for label, path in inputs:
        if not path.is_dir():
            raise ValueError(f"{label} {path}: not a directory")
    maps = check_compatible(inputs)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a previous merge that died half-way
    tmp.mkdir(parents=True)
    started = time.perf_counter()
    try:
        count = _merge_into(maps, coefs, tmp)
        template = inputs[0][1]  # config, index and tokenizer files, as saved
        for file in template.iterdir():
            if file.is_file() and file.name != RECORD and not file.name.endswith(OTHER_WEIGHTS):
                shutil.copy2(file, tmp / file.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    record = {
        "out": str(out),
        "lambda": lam,
        "coefficients": coefs,
        "inputs": [str(p) for _, p in inputs],
        "beta": beta,
        "preference": preference,
        "alphas": alphas,
        "num_tensors": count,
        "seconds": time.perf_counter() - started,
    }
    (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(out)
    return record


def main(args: argparse.Namespace) -> int:
    record = merge_directories(
        args.backbones, args.out, beta=args.beta, preference=args.preference, sft=args.sft, alphas=args.alpha
    )
    if not args.json:
        lam = ", ".join(f"{x:+.4f}" for x in record["lambda"])
        print(f"merged {len(args.backbones)} backbones into {record['out']}: lambda = ({lam})")
    print(json.dumps(record))
    return 0
