"""`yatt-plan` (run here as `python -m yatt_placement.cli` or through `main`): table, JSON, and errors."""

import json
import subprocess
import sys

import msgspec
from yatt_placement.cli import main
from yatt_placement.types import PlacementPlan

CONFIG = {
    "cluster": {"num_nodes": 2, "devices_per_node": 8, "device_memory_gb": 96.0},
    "roles": [
        {"role": "actor", "num_params": 1.5e9, "trainable": True},
        {"role": "rollout", "num_params": 1.5e9, "tensor_parallel": 2},
        {"role": "genrm", "num_params": 72e9, "tensor_parallel": 8, "name": "judge"},
    ],
    "profile": {"device_seconds": {"actor": 10.0, "rollout": 50.0, "judge": 50.0}},
}


def test_table_for_the_papers_16_device_example(tmp_path, capsys):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(CONFIG))
    assert main(["--config", str(path), "--mode", "partial"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "mode partial, 16 devices, version 0",
        "role     name   devices  replicas  group  device ids  shares with",
        "actor    -      16       16        1      0-15        rollout, judge",
        "rollout  -      8        4         2      0-7         actor",
        "genrm    judge  8        1         8      8-15        actor",
        "reason: split rollout 8, judge 8: predicted concurrent time 6.25 s per step (profiled)",
    ]


def test_json_output_is_a_placement_plan(tmp_path, capsys):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(CONFIG))
    assert main(["--config", str(path), "--mode", "disaggregated", "--json"]) == 0
    result = msgspec.json.decode(capsys.readouterr().out, type=PlacementPlan)
    assert result.mode == "disaggregated"
    # One group each (actor 1, rollout 2, judge 8), then 5 left by largest work / devices:
    # rollout 50/2 -> 4, rollout 50/4 = 12.5 > actor 10 -> 6, one device left: actor -> 2.
    assert {(p.name or p.role): sum(map(len, p.replicas)) for p in result.roles} == {
        "actor": 2,
        "rollout": 6,
        "judge": 8,
    }


def test_bad_config_names_the_field_and_exits_2(tmp_path, capsys):
    bad = {**CONFIG, "roles": [{"role": "actor", "num_params": 1e9, "tensor_parallel": "two"}]}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"yatt-plan: error: {path}: Expected `int`, got `str` - at `$.roles[0].tensor_parallel`\n"
    assert main(["--config", str(tmp_path / "missing.json")]) == 2
    assert "No such file or directory" in capsys.readouterr().err


def test_impossible_plan_exits_2_naming_the_role(tmp_path, capsys):
    tight = {**CONFIG, "cluster": {"num_nodes": 2, "devices_per_node": 8, "device_memory_gb": 20.0}}
    path = tmp_path / "tight.json"
    path.write_text(json.dumps(tight))
    assert main(["--config", str(path), "--mode", "colocated"]) == 2
    # The actor fits (1.5e9 x (9 + 12/16) = 14.6 GB + 4); the judge's 72e9 x 2 / 8 = 18 GB + 4 does not.
    assert "role 'judge' (genrm) needs 22.0 GB per device over 16 devices" in capsys.readouterr().err


def test_module_entry_point_with_a_scenario():
    out = subprocess.run(
        [sys.executable, "-m", "yatt_placement.cli", "--scenario", "paper", "--mode", "partial"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.splitlines()[3].split() == ["rollout", "-", "8", "8", "1", "0-7", "actor"]
