"""`yatt merge` (Bone Soup) on tiny Qwen2 backbones built from configs and saved as HF directories: the merged
tensors are the hand-worked combinations of the inputs (exactly, in fp32), agree with
`yatt_algos.bone_soup.bone_soup_merge`, load with `from_pretrained`, and bad input exits 2 naming the argument
and the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from yatt_algos.bone_soup import bone_soup_merge  # noqa: E402
from yatt_apps.cli.main import main  # noqa: E402
from yatt_rollout.tiny import save_tiny, tiny_causal_lm, train_tokenizer  # noqa: E402

CORPUS = ["1 + 2 = 3", "7 - 4 = 3", "Is the answer correct? Yes No"] * 8


def _weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory, single file or sharded."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """sft (seed 0), backbones a, b, c (seeds 1-3; a sharded in several files), and misfits."""
    root = tmp_path_factory.mktemp("soup")
    tok = train_tokenizer(CORPUS, vocab_size=300)
    dirs = {}
    for name, seed in {"sft": 0, "a": 1, "b": 2, "c": 3}.items():
        dirs[name] = save_tiny(tiny_causal_lm(len(tok), seed=seed), tok, root / name)
    sharded = root / "a_sharded"  # same weights as a, in shards of at most 100 kB
    tiny_causal_lm(len(tok), seed=1).save_pretrained(sharded, max_shard_size="100KB")
    tok.save_pretrained(sharded)
    dirs["a_sharded"] = sharded
    dirs["wide"] = save_tiny(tiny_causal_lm(len(tok), hidden_size=96, seed=4), tok, root / "wide")
    dirs["llama"] = save_tiny(tiny_causal_lm(len(tok), arch="llama", seed=5), tok, root / "llama")
    dropped = root / "dropped"  # b's config, one tensor missing from the weights
    save_tiny(tiny_causal_lm(len(tok), seed=2), tok, dropped)
    weights = load_file(dropped / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, dropped / "model.safetensors", metadata={"format": "pt"})
    dirs["dropped"] = dropped
    return dirs


def _merge(capsys, *argv: str) -> dict:
    assert main(["merge", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_paper_example_is_exact_in_fp32(models, tmp_path, capsys):
    # B rows (0.3, 0.7), (0.7, 0.3) is beta = 0.3; B^T lambda = (1, 0): 0.3 l1 + 0.7 l2 = 1, l1 + l2 = 1
    # -> 0.3 + 0.4 l2 = 1 -> l2 = 1.75, l1 = -0.75 (PAPERS.md)
    out = tmp_path / "merged"
    record = _merge(
        capsys,
        "--backbones",
        str(models["a"]),
        str(models["b"]),
        "--beta",
        "0.3",
        "--preference",
        "1",
        "0",
        "--out",
        str(out),
    )
    assert record["lambda"] == pytest.approx([-0.75, 1.75], abs=1e-12)
    assert record["coefficients"] == record["lambda"] and record["num_tensors"] == len(_weights(out))
    a, b, merged = _weights(models["a"]), _weights(models["b"]), _weights(out)
    # per layer: q, k, v (weight and bias), o, gate, up, down, 2 norms = 12; plus embed, final norm, lm_head
    assert sorted(merged) == sorted(a) and len(merged) == 2 * 12 + 3
    for name, tensor in merged.items():
        assert tensor.dtype == torch.float32
        expected = torch.zeros_like(a[name]).add_(a[name], alpha=-0.75).add_(b[name], alpha=1.75)
        assert torch.equal(tensor, expected), name
        # and the same to fp32 rounding as the textbook -0.75 A + 1.75 B
        torch.testing.assert_close(tensor, -0.75 * a[name] + 1.75 * b[name], rtol=1e-6, atol=1e-7)
    assert json.loads((out / "bone_soup.json").read_text())["lambda"] == record["lambda"]
    assert not (tmp_path / "merged.tmp").exists()


def test_beta_0_7_matches_bone_soup_merge_and_loads(models, tmp_path, capsys):
    # beta 0.7: 0.7 l1 + 0.3 l2 = 0.2, l1 + l2 = 1 -> 0.4 l1 = -0.1 -> lambda = (-0.25, 1.25)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    record = _merge(
        capsys,
        "--backbones",
        str(models["a"]),
        str(models["b"]),
        "--beta",
        "0.7",
        "--preference",
        "0.2",
        "0.8",
        "--out",
        str(out),
    )
    assert record["lambda"] == pytest.approx([-0.25, 1.25], abs=1e-12)
    reference = bone_soup_merge([_weights(models["a"]), _weights(models["b"])], [0.2, 0.8], beta=0.7)
    merged = _weights(out)
    assert all(torch.equal(merged[name], reference[name]) for name in reference)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[name], merged[name]) for name in merged)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok("1 + 2 =")["input_ids"] == AutoTokenizer.from_pretrained(models["a"])("1 + 2 =")["input_ids"]


def test_equal_preference_is_the_average(models, tmp_path, capsys):
    # mu = (0.5, 0.5) gives lambda = (0.5, 0.5) for any beta (PAPERS.md)
    out = tmp_path / "merged"
    record = _merge(
        capsys,
        "--backbones",
        str(models["a"]),
        str(models["b"]),
        "--beta",
        "0.8",
        "--preference",
        "0.5",
        "0.5",
        "--out",
        str(out),
    )
    assert record["lambda"] == pytest.approx([0.5, 0.5], abs=1e-12)
    a, b, merged = _weights(models["a"]), _weights(models["b"]), _weights(out)
    for name in merged:
        torch.testing.assert_close(merged[name], (a[name] + b[name]) / 2, rtol=0, atol=1e-7)


def test_three_backbones_with_sft_extrapolation(models, tmp_path, capsys):
    # n = 3, beta 0.6: B = 0.4 I + 0.2 J, so B^T lambda = 0.4 lambda + 0.2 (sum lambda = 1) = mu
    # -> lambda = (mu - 0.2) / 0.4 = (2, -0.5, -0.5) for mu = (1, 0, 0).
    # alpha 0.5 -> k = 2: coefficients over (sft, a, b, c) = (1 - 2 (2 - 0.5 - 0.5), 4, -1, -1) = (-1, 4, -1, -1)
    out = tmp_path / "merged"
    backbones = [str(models[k]) for k in "abc"]
    record = _merge(
        capsys,
        "--backbones",
        *backbones,
        "--beta",
        "0.6",
        "--preference",
        "1",
        "0",
        "0",
        "--sft",
        str(models["sft"]),
        "--alpha",
        "0.5",
        "--out",
        str(out),
    )
    assert record["lambda"] == pytest.approx([2.0, -0.5, -0.5], abs=1e-12)
    assert record["coefficients"] == pytest.approx([-1.0, 4.0, -1.0, -1.0], abs=1e-12)
    sft = _weights(models["sft"])
    reference = bone_soup_merge(
        [_weights(models[k]) for k in "abc"], [1, 0, 0], beta=0.6, sft=sft, alphas=[0.5, 0.5, 0.5]
    )
    merged = _weights(out)
    a, b, c = (_weights(models[k]) for k in "abc")
    for name in merged:
        assert torch.equal(merged[name], reference[name]), name
        expected = -sft[name] + 4 * a[name] - b[name] - c[name]
        torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-6)


def test_sharded_input_keeps_its_layout(models, tmp_path, capsys):
    out = tmp_path / "merged"
    _merge(
        capsys,
        "--backbones",
        str(models["a_sharded"]),
        str(models["b"]),
        "--beta",
        "0.3",
        "--preference",
        "1",
        "0",
        "--out",
        str(out),
    )
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == sorted(p.name for p in models["a_sharded"].glob("*.safetensors")) and len(shards) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(shards)
    a, b, merged = _weights(models["a"]), _weights(models["b"]), _weights(out)
    for name in merged:  # a_sharded holds a's weights (same seed)
        expected = torch.zeros_like(a[name]).add_(a[name], alpha=-0.75).add_(b[name], alpha=1.75)
        assert torch.equal(merged[name], expected), name


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--backbones", "{a}", "{wide}", "--beta", "0.7", "--preference", "0.5", "0.5"],
            r"--backbones\[1\] .*wide/config\.json: architecture differs from --backbones\[0\] .*: hidden_size 96 vs 64",
        ),
        (
            ["--backbones", "{a}", "{llama}", "--beta", "0.7", "--preference", "0.5", "0.5"],
            r"--backbones\[1\] .*llama/config\.json: architecture differs .*architectures \['LlamaForCausalLM'\]",
        ),
        (
            ["--backbones", "{a}", "{dropped}", "--beta", "0.7", "--preference", "0.5", "0.5"],
            r"--backbones\[1\] .*dropped: tensor names differ from --backbones\[0\] .*missing \['model\.norm\.weight'\]",
        ),
        (
            ["--backbones", "{a}", "{b}", "--beta", "0.7", "--preference", "0.7", "0.7"],
            r"--preference: preference must be on the simplex \(>= 0, sum 1\), got \[0\.7, 0\.7\]",
        ),
        (
            ["--backbones", "{a}", "{b}", "--beta", "0.7", "--preference", "1.5", "-0.5"],
            r"--preference: preference must be on the simplex",
        ),
        (
            ["--backbones", "{a}", "{b}", "--beta", "0.7", "--preference", "0.2", "0.3", "0.5"],
            r"--preference has 3 values for 2 --backbones",
        ),
        (
            ["--backbones", "{a}", "--beta", "0.7", "--preference", "1"],
            r"--backbones needs at least 2 directories, got 1",
        ),
        (
            ["--backbones", "{a}", "{b}", "--beta", "0.5", "--preference", "1", "0"],
            r"--beta: beta = 1/2 makes B singular",
        ),
        (
            ["--backbones", "{a}", "{b}", "--beta", "0.7", "--preference", "1", "0", "--alpha", "0.2"],
            r"--alpha needs --sft",
        ),
        (
            [
                "--backbones",
                "{a}",
                "{b}",
                "--beta",
                "0.7",
                "--preference",
                "1",
                "0",
                "--sft",
                "{sft}",
                "--alpha",
                "1.0",
            ],
            r"--alpha: alpha must be in \[0, 1\), got 1\.0",
        ),
        (
            [
                "--backbones",
                "{a}",
                "{b}",
                "{c}",
                "--beta",
                "0.7",
                "--preference",
                "1",
                "0",
                "0",
                "--sft",
                "{sft}",
                "--alpha",
                "0.1",
                "0.2",
            ],
            r"--alpha has 2 values: give one, or one per backbone \(3\)",
        ),
        (
            ["--backbones", "{a}", "{a}/nowhere", "--beta", "0.7", "--preference", "1", "0"],
            r"--backbones\[1\] .*/nowhere: not a directory",
        ),
        (
            ["--backbones", "{a}", "{b}", "--sft", "{wide}", "--beta", "0.7", "--preference", "1", "0"],
            r"--backbones\[0\] .*a/config\.json: architecture differs from --sft .*wide",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_argument(models, tmp_path, capsys, argv, message):
    out = tmp_path / "merged"
    argv = [arg.format(**{k: str(v) for k, v in models.items()}) for arg in argv]
    assert main(["merge", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("yatt merge: error: ") and re.search(message, err), err
    assert not out.exists() and not (tmp_path / "merged.tmp").exists()


def test_broken_weights_exit_2_naming_the_file(models, tmp_path, capsys):
    import shutil

    torn = shutil.copytree(models["a_sharded"], tmp_path / "torn")  # an index whose last shard is gone
    last = sorted(torn.glob("*.safetensors"))[-1]
    last.unlink()
    corrupt = shutil.copytree(models["b"], tmp_path / "corrupt")  # a truncated header
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00")
    for bad, message in (
        (
            torn,
            f"--backbones[1] {torn}/model.safetensors.index.json: lists shard(s) that "
            f"are not there: ['{last.name}']",
        ),
        (corrupt, f"--backbones[1] {corrupt}/model.safetensors: not a readable safetensors"),
    ):
        out = tmp_path / "merged"
        assert (
            main(
                [
                    "merge",
                    "--backbones",
                    str(models["a"]),
                    str(bad),
                    "--beta",
                    "0.7",
                    "--preference",
                    "1",
                    "0",
                    "--out",
                    str(out),
                ]
            )
            == 2
        )
        assert message in capsys.readouterr().err
        assert not out.exists() and not (tmp_path / "merged.tmp").exists()


def test_parser_stays_light():
    # `yatt --help` builds every subcommand's parser, merge's options included, without loading torch
    import subprocess
    import sys

    code = (
        "import sys, yatt_apps.cli.main as c; p = c.build_parser(); "
        "a = p.parse_args(['merge', '--backbones', 'x', 'y', '--beta', '0.7', '--preference', '1', '0', "
        "'--out', 'z']); assert a.preference == [1.0, 0.0] and a.alpha is None, a; "
        "assert 'torch' not in sys.modules and 'safetensors' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_existing_output_and_non_model_directory_exit_2(models, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    assert (
        main(
            [
                "merge",
                "--backbones",
                str(models["a"]),
                str(models["b"]),
                "--beta",
                "0.7",
                "--preference",
                "1",
                "0",
                "--out",
                str(taken),
            ]
        )
        == 2
    )
    assert f"--out {taken} already exists" in capsys.readouterr().err
    assert (
        main(
            [
                "merge",
                "--backbones",
                str(models["a"]),
                str(tmp_path),
                "--beta",
                "0.7",
                "--preference",
                "1",
                "0",
                "--out",
                str(tmp_path / "m"),
            ]
        )
        == 2
    )
    assert f"--backbones[1] {tmp_path}: not an HF model directory (no config.json)" in capsys.readouterr().err
