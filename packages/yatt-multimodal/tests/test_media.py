"""MediaRef loading and validation: paths, file:// and data: URIs, limits, corrupt files, remote URLs (off by
default; on, fetched from a server on localhost)."""

import hashlib
import http.server
import threading
from functools import partial

import pytest
from PIL import Image
from yatt_multimodal.media import MediaError, image_data_uri, load_image, read_media_bytes
from yatt_multimodal.types import MediaLimits
from yatt_rollout.types import MediaRef


def _image(width=6, height=4, color=(200, 10, 30)):
    return Image.new("RGB", (width, height), color)


@pytest.fixture
def png(tmp_path):
    path = tmp_path / "red.png"
    _image().save(path)
    return path


def test_path_file_uri_and_data_uri_load_the_same_pixels(png, tmp_path):
    by_path = load_image(MediaRef(kind="image", uri=str(png)))
    by_file_uri = load_image(MediaRef(kind="image", uri=png.as_uri()))
    by_relative = load_image(MediaRef(kind="image", uri="red.png"), base_dir=tmp_path)
    by_data = load_image(MediaRef(kind="image", uri=image_data_uri(_image())))
    for image in (by_path, by_file_uri, by_relative, by_data):
        assert (image.size, image.mode, image.getpixel((5, 3))) == ((6, 4), "RGB", (200, 10, 30))


def test_checksum(png):
    digest = hashlib.sha256(png.read_bytes()).hexdigest()
    assert read_media_bytes(MediaRef(kind="image", uri=str(png), sha256=digest)) == png.read_bytes()
    with pytest.raises(MediaError, match=r"sha256 does not match MediaRef\.sha256"):
        read_media_bytes(MediaRef(kind="image", uri=str(png), sha256="0" * 64))


def test_bad_media_fail_with_the_uri_and_the_reason(png, tmp_path):
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(png.read_bytes()[:40])  # header intact, pixel data cut off
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"this is not an image")
    cases = [
        (str(tmp_path / "missing.png"), MediaLimits(), "'.*missing.png': file not found"),
        (str(corrupt), MediaLimits(), "'.*corrupt.png': not a readable image"),
        (str(garbage), MediaLimits(), "'.*garbage.png': not a readable image"),
        (str(png), MediaLimits(max_bytes=10), r"bytes exceeds MediaLimits\.max_bytes=10"),
        (str(png), MediaLimits(max_pixels=23), r"6x4 pixels exceeds MediaLimits\.max_pixels=23"),  # 24 > 23
        (str(png), MediaLimits(min_side=5), r"6x4 is below MediaLimits\.min_side=5"),
        (str(png), MediaLimits(formats=("JPEG",)), r"format PNG is not in MediaLimits\.formats=\['JPEG'\]"),
        ("data:image/png;base64,@@@", MediaLimits(), "invalid base64"),
        ("data:image/png,rawbytes", MediaLimits(), "a data URI must be 'data:<mime>;base64,<payload>'"),
        ("ftp://host/a.png", MediaLimits(), "unsupported scheme 'ftp'"),
        (
            "https://example.com/a.png",
            MediaLimits(),
            r"remote URLs are disabled \(MediaLimits.allow_remote=False\)",
        ),
    ]
    for uri, limits, message in cases:
        with pytest.raises(MediaError, match=message):
            load_image(MediaRef(kind="image", uri=uri), limits)
    with pytest.raises(MediaError, match="kind 'video' is not an image"):
        load_image(MediaRef(kind="video", uri=str(png)))


def test_limits_config_rejects_bad_values():
    with pytest.raises(ValueError, match=r"MediaLimits\.max_bytes must be >= 1, got 0"):
        MediaLimits(max_bytes=0)


def test_remote_url_when_allowed(png):
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(png.parent))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        image = load_image(MediaRef(kind="image", uri=f"{base}/red.png"), MediaLimits(allow_remote=True))
        assert image.getpixel((0, 0)) == (200, 10, 30)
        with pytest.raises(MediaError, match=r"fetch failed \(HTTP Error 404"):
            load_image(MediaRef(kind="image", uri=f"{base}/nope.png"), MediaLimits(allow_remote=True))
        with pytest.raises(MediaError, match=r"exceeds MediaLimits\.max_bytes=10"):
            load_image(
                MediaRef(kind="image", uri=f"{base}/red.png"), MediaLimits(allow_remote=True, max_bytes=10)
            )
    finally:
        server.shutdown()
        server.server_close()
