"""A resume names every checkpoint it skips and why, and refuses when none verifies (issue 33): a corrupt newest
checkpoint is never skipped silently, and a run whose checkpoints are all broken is never restarted from 0."""

from __future__ import annotations

import os

import pytest
from yatt_controller import checkpoint, recovery


def _three(root):
    """Checkpoints of steps 1, 2, 3 with one blob each (the bytes of the step)."""
    for step in (1, 2, 3):
        checkpoint.write_checkpoint(root, step, {"model.bin": bytes([step]) * 4}, keep=3)


def test_a_corrupt_newest_checkpoint_is_named_and_the_older_valid_one_chosen(tmp_path):
    root = tmp_path / "ckpt"
    _three(root)
    (root / "step-00000003" / "model.bin").write_bytes(b"\x03\x03\x03\xff")  # same size, other bytes
    lines: list[str] = []
    path, manifest = checkpoint.resumable(root, report=lines.append)
    assert (path, manifest.step) == (root / "step-00000002", 2)
    assert lines == [
        f"skipped checkpoint {root}/step-00000003: model.bin does not match its manifest entry (size or sha256)"
    ]


def test_every_kind_of_damage_is_named_newest_first(tmp_path):
    root = tmp_path / "ckpt"
    _three(root)
    (root / "step-00000003" / "model.bin").unlink()
    (root / "step-00000002" / checkpoint.MANIFEST).write_bytes(b"{not json")
    lines: list[str] = []
    assert checkpoint.resumable(root, report=lines.append)[1].step == 1
    assert lines[0] == (
        f"skipped checkpoint {root}/step-00000003: model.bin is listed in the manifest but missing"
    )
    assert lines[1].startswith(
        f"skipped checkpoint {root}/step-00000002: manifest.json is not a valid manifest ("
    )
    assert len(lines) == 2


def test_all_corrupt_refuses_naming_each_and_changes_nothing(tmp_path):
    root = tmp_path / "ckpt"
    _three(root)
    for step in (1, 2, 3):
        (root / f"step-{step:08d}" / "model.bin").write_bytes(b"bad")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.raises(checkpoint.NoValidCheckpoint) as err:
        checkpoint.resumable(root, report=pytest.fail)
    assert str(err.value) == (
        f"{root}: no checkpoint verifies against its manifest, so the run cannot resume (nothing was changed):\n"
        + "".join(
            f"  {root}/step-{s:08d}: model.bin does not match its manifest entry (size or sha256)\n"
            for s in (3, 2, 1)
        )
        + "restore them, or move them away to start the run over"
    )
    assert isinstance(err.value, ValueError)  # the apps' CLI: exit 2, bad input
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_no_checkpoint_at_all_is_a_fresh_start(tmp_path):
    assert checkpoint.resumable(tmp_path / "missing", report=pytest.fail) is None
    os.makedirs(tmp_path / "ckpt" / ".staging-step-00000001")  # a crashed write is not a checkpoint
    assert checkpoint.resumable(tmp_path / "ckpt", report=pytest.fail) is None


def test_the_runtime_resume_point_reports_on_stderr_and_refuses(tmp_path, capsys):
    """The controller's own resume (`recovery.resume_point`, what every attempt calls) goes through it."""
    root = tmp_path / "ckpt"
    _three(root)
    (root / "step-00000003" / "model.bin").write_bytes(b"")
    assert recovery.resume_point(str(root)) == root / "step-00000002"
    assert capsys.readouterr().err == (
        f"skipped checkpoint {root}/step-00000003: model.bin does not match its manifest entry (size or sha256)\n"
    )
    for step in (1, 2):
        (root / f"step-{step:08d}" / checkpoint.MANIFEST).unlink()
    with pytest.raises(checkpoint.NoValidCheckpoint, match="no checkpoint verifies against its manifest"):
        recovery.resume_point(str(root))
