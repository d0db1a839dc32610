"""Media references and image placeholder expansion."""

import base64
import hashlib

import pytest
from yatt_rollout.media import expand_image_tokens, read_media_bytes
from yatt_rollout.types import MediaRef

IMG = 9  # the image placeholder id in these examples


def test_single_placeholders_expand_per_image():
    # image 0 needs 3 tokens, image 1 needs 2
    assert expand_image_tokens([1, IMG, 2, IMG, 3], IMG, [3, 2]) == [1, IMG, IMG, IMG, 2, IMG, IMG, 3]


def test_already_expanded_prompt_is_kept():
    ids = [1, IMG, IMG, IMG, 2]
    assert expand_image_tokens(ids, IMG, [3]) == ids


@pytest.mark.parametrize(
    ("ids", "counts", "message"),
    [
        ([1, IMG, 2], [3, 2], "prompt has 1 image placeholders but 2 images in prompt.media"),
        ([1, 2], [4], "prompt has 0 image placeholders but 1 images"),
        ([IMG, IMG, 2], [4], "image placeholder of 2 tokens; the image needs 1 or 4"),
    ],
)
def test_placeholders_and_images_must_agree(ids, counts, message):
    with pytest.raises(ValueError, match=message):
        expand_image_tokens(ids, IMG, counts)


def test_read_media_bytes_paths_uris_and_integrity(tmp_path):
    payload = b"\x89PNG not really"
    path = tmp_path / "a.png"
    path.write_bytes(payload)
    digest = hashlib.sha256(payload).hexdigest()
    assert read_media_bytes(MediaRef(kind="image", uri=str(path), sha256=digest)) == payload
    assert read_media_bytes(MediaRef(kind="image", uri=f"file://{path}")) == payload
    data_uri = "data:image/png;base64," + base64.b64encode(payload).decode()
    assert read_media_bytes(MediaRef(kind="image", uri=data_uri)) == payload
    with pytest.raises(ValueError, match="sha256 does not match"):
        read_media_bytes(MediaRef(kind="image", uri=str(path), sha256="0" * 64))
    with pytest.raises(ValueError, match=f"image file not found: {tmp_path / 'missing.png'}"):
        read_media_bytes(MediaRef(kind="image", uri=str(tmp_path / "missing.png")))
