"""Atomic checkpoints: written aside, manifest last, then renamed; keep the last k; resume the newest
complete one.

Layout under a root: `step-00000012/` (complete: it holds `manifest.json`, a `CheckpointManifest` naming every
file with its size and sha256) and `.staging-step-00000012/` (being written, or left by a crash: never read).
A directory only gets its final name after its manifest is on disk, and resume re-checks every file against
the manifest, so a half-written checkpoint is never loaded. A resume (`resumable`) says which checkpoints it
skipped and why, and refuses when checkpoints exist but none verifies (`NoValidCheckpoint`): a run is never
silently restarted from step 0 over its records. Several writers (one per controller) may write into one
staging directory; one of them commits.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec

from yatt_controller.types import CheckpointManifest

MANIFEST = "manifest.json"
_PREFIX, _STAGING = "step-", ".staging-step-"


def _name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def staging_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"{_STAGING}{step:08d}"


def begin(root: str | os.PathLike, step: int) -> Path:
    """A fresh, empty staging directory for `step`. A crashed attempt's leftovers are removed: this step's,
    and every later step's (a run goes forward, so a staging directory of a later step than the one
    beginning was left by an attempt that died; `commit` removes the earlier ones)."""
    remove_staging(root, lambda other: other >= step)
    staging = staging_dir(root, step)
    staging.mkdir(parents=True)
    return staging


def staging_steps(root: str | os.PathLike) -> list[int]:
    """The steps of the staging directories under `root`, ascending (being written, or left by a crash)."""
    root = Path(root)
    if not root.is_dir():
        return []
    names = [p.name[len(_STAGING) :] for p in root.iterdir() if p.is_dir() and p.name.startswith(_STAGING)]
    return sorted(int(n) for n in names if n.isdigit())


def remove_staging(root: str | os.PathLike, which: Callable[[int], bool]) -> None:
    """Remove the staging directories of the steps `which` selects."""
    for step in staging_steps(root):
        if which(step):
            shutil.rmtree(staging_dir(root, step), ignore_errors=True)


def write_file(staging: Path, relpath: str, data: bytes) -> tuple[str, int]:
    """Write one file durably; returns (sha256 hex, size)."""
    if Path(relpath).is_absolute() or ".." in Path(relpath).parts or relpath == MANIFEST:
        raise ValueError(
            f"checkpoint file name must be a relative path inside the checkpoint, got {relpath!r}"
        )
    path = staging / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest(), len(data)


def commit(
    root: str | os.PathLike,
    step: int,
    files: Mapping[str, tuple[str, int]],
    *,
    policy_version: int = 0,
    keep: int = 2,
) -> Path:
    """Write the manifest last, rename the staging directory to its final name, prune to the newest `keep`
    and remove the staging directories of earlier steps (a newer checkpoint supersedes them: a crash left
    them, or the writer abandoned them)."""
    staging, final = staging_dir(root, step), Path(root) / _name(step)
    manifest = CheckpointManifest(
        step=step,
        created_unix=time.time(),
        files={path: sha for path, (sha, _) in files.items()},
        sizes={path: size for path, (_, size) in files.items()},
        policy_version=policy_version,
    )
    write_file_raw = msgspec.json.encode(manifest)
    with open(staging / MANIFEST, "wb") as f:
        f.write(write_file_raw)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)  # a re-run of the same step replaces it
    os.rename(staging, final)
    _fsync_dir(Path(root))
    prune(root, keep)
    remove_staging(root, lambda other: other < step)
    return final


def write_checkpoint(
    root: str | os.PathLike, step: int, files: Mapping[str, bytes], *, policy_version: int = 0, keep: int = 2
) -> Path:
    """One writer's whole checkpoint: begin, write every file, commit."""
    staging = begin(root, step)
    written = {path: write_file(staging, path, data) for path, data in files.items()}
    return commit(root, step, written, policy_version=policy_version, keep=keep)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_steps(root: str | os.PathLike) -> list[int]:
    """Steps with a final-named directory, ascending (not yet verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        int(p.name[len(_PREFIX) :]) for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)
    )


def prune(root: str | os.PathLike, keep: int) -> None:
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    for step in complete_steps(root)[:-keep]:
        shutil.rmtree(Path(root) / _name(step), ignore_errors=True)


class NoValidCheckpoint(ValueError):
    """Checkpoints exist but none verifies: resuming would silently start over, so the resume is refused."""


def verify(path: Path) -> CheckpointManifest:
    """The manifest of a checkpoint directory, after checking every file's size and sha256; ValueError
    naming the checkpoint and the file otherwise."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{path}: no {MANIFEST}, the checkpoint is incomplete")
    try:
        manifest = msgspec.json.decode(manifest_path.read_bytes(), type=CheckpointManifest)
    except msgspec.DecodeError as err:
        raise ValueError(f"{path}: {MANIFEST} is not a valid manifest ({err})") from None
    for relpath, sha in manifest.files.items():
        file = path / relpath
        if not file.is_file():
            raise ValueError(f"{path}: {relpath} is listed in the manifest but missing")
        data = file.read_bytes()
        if len(data) != manifest.sizes.get(relpath, len(data)) or hashlib.sha256(data).hexdigest() != sha:
            raise ValueError(f"{path}: {relpath} does not match its manifest entry (size or sha256)")
    return manifest


def scan(root: str | os.PathLike) -> tuple[tuple[Path, CheckpointManifest] | None, list[str]]:
    """(the newest checkpoint that verifies, or None; why each newer one was skipped, newest first: one
    `verify` error each, naming the checkpoint's path and the file)."""
    skipped: list[str] = []
    for step in reversed(complete_steps(root)):
        path = Path(root) / _name(step)
        try:
            return (path, verify(path)), skipped
        except ValueError as err:
            skipped.append(str(err))
    return None, skipped


def latest(root: str | os.PathLike) -> tuple[Path, CheckpointManifest] | None:
    """The newest checkpoint that verifies, or None. Broken ones are skipped quietly, never loaded: a resume
    uses `resumable`, which says what it skipped."""
    return scan(root)[0]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resumable(
    root: str | os.PathLike, report: Callable[[str], None] = _stderr
) -> tuple[Path, CheckpointManifest] | None:
    """The checkpoint a resume continues from: the newest that verifies (None: there is no checkpoint, a
    fresh start). Each newer one that does not verify is reported as `skipped checkpoint PATH: WHY`; when
    checkpoints exist and none verifies, `NoValidCheckpoint` lists them (nothing has been changed)."""
    found, skipped = scan(root)
    if found is None and skipped:
        reasons = "\n".join(f"  {why}" for why in skipped)
        raise NoValidCheckpoint(
            f"{root}: no checkpoint verifies against its manifest, so the run cannot resume (nothing was "
            f"changed):\n{reasons}\nrestore them, or move them away to start the run over"
        )
    for why in skipped:
        report(f"skipped checkpoint {why}")
    return found
