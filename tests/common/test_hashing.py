"""Block hashes, item identifiers and model fingerprints."""

import json
import os
import time

import torch

from common.hashing import block_extra_keys, hash_block, hash_request_blocks, item_identifier, model_fingerprint
from common.multimodal import Modality, MultiModalFeatureSpec, PlaceholderRange

PAD = 151  # an image placeholder id


def item(ident, offset, length):
    return MultiModalFeatureSpec(
        data=None, modality=Modality.IMAGE, identifier=ident, mm_position=PlaceholderRange(offset, length)
    )


def prompt_with_image_at(offset, length, total):
    return [1] * offset + [PAD] * length + [2] * (total - offset - length)


def test_only_full_blocks_hash_and_chain():
    tokens = list(range(40))
    hashes = hash_request_blocks(tokens, [], 16)
    assert len(hashes) == 2
    assert hashes[1] == hash_block(hashes[0], tokens[16:32])
    # extending from a parent gives the same hashes without rehashing earlier blocks
    more = list(range(48))
    assert hash_request_blocks(more, [], 16, parent=hashes[1], start_block=2) == hash_request_blocks(more, [], 16)[2:]


def test_same_image_same_position_agrees():
    toks = prompt_with_image_at(5, 20, 48)
    a = hash_request_blocks(toks, [item("A", 5, 20)], 16)
    b = hash_request_blocks(list(toks), [item("A", 5, 20)], 16)
    assert a == b


def test_image_moved_changes_hashes_from_its_first_block():
    moved_tokens = prompt_with_image_at(6, 20, 48)
    a = hash_request_blocks(prompt_with_image_at(5, 20, 48), [item("A", 5, 20)], 16)
    b = hash_request_blocks(moved_tokens, [item("A", 6, 20)], 16)
    assert a[0] != b[0]
    # same tokens, but the item's offset differs relative to the block -> different hash
    c = hash_request_blocks(moved_tokens, [item("A", 5, 20)], 16)
    assert c[0] != b[0]


def test_different_images_behind_identical_placeholders_differ():
    toks = prompt_with_image_at(5, 20, 48)
    a = hash_request_blocks(toks, [item("A", 5, 20)], 16)
    b = hash_request_blocks(toks, [item("B", 5, 20)], 16)
    assert a[0] != b[0] and a[1] != b[1]
    assert a[2] != b[2]  # chained: later text blocks differ too


def test_blocks_before_the_image_are_shared():
    toks = [3] * 16 + [PAD] * 10 + [4] * 22
    a = hash_request_blocks(toks, [item("A", 16, 10)], 16)
    b = hash_request_blocks(toks, [item("B", 16, 10)], 16)
    assert a[0] == b[0] and a[1] != b[1]


def test_salt_isolates_from_the_first_block():
    toks = list(range(32))
    assert hash_request_blocks(toks, [], 16, salt="t1")[0] != hash_request_blocks(toks, [], 16, salt="t2")[0]
    assert hash_request_blocks(toks, [], 16, salt="t1") == hash_request_blocks(toks, [], 16, salt="t1")
    assert hash_request_blocks(toks, [], 16, salt=None)[0] != hash_request_blocks(toks, [], 16, salt="t1")[0]


def test_extra_keys_are_relative_and_cover_straddling_items():
    feats = [item("A", 10, 10), item("B", 20, 40)]
    keys, resume = block_extra_keys(feats, 16, 32)
    assert keys == [("A", -6), ("B", 4)] and resume == 0
    keys, resume = block_extra_keys(feats, 48, 64, resume)
    assert keys == [("B", -28)] and resume == 1


def test_item_identifier_depends_on_bytes_and_settings():
    a = item_identifier(b"jpegbytes", {"max_pixels": 100})
    assert a == item_identifier(b"jpegbytes", {"max_pixels": 100})
    assert a != item_identifier(b"jpegbytez", {"max_pixels": 100})
    assert a != item_identifier(b"jpegbytes", {"max_pixels": 101})
    assert len(a) == 64


def test_model_fingerprint_tracks_config_and_weights(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"hidden": 1}))
    save_file({"w": torch.zeros(4)}, tmp_path / "model.safetensors")
    first = model_fingerprint(tmp_path)
    assert first == model_fingerprint(tmp_path)
    save_file({"w": torch.ones(4)}, tmp_path / "model.safetensors")
    second = model_fingerprint(tmp_path)
    assert second != first
    (tmp_path / "config.json").write_text(json.dumps({"hidden": 2}))
    assert model_fingerprint(tmp_path) not in (first, second)


# --- model fingerprint: whole content, digests cached by file identity ------------------------------------------


def _big_weights(path, last_byte: bytes, size: int = 65 << 20) -> None:
    """A safetensors-shaped file over the old 64 MiB header-only limit; only its last byte varies (sparse)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [size - 8 - 64], "data_offsets": [0, size - 8 - 64]}})
    header = header.ljust(64).encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.seek(size - 1)
        f.write(last_byte)


def test_fine_tunes_of_one_shape_differ_beyond_the_header(tmp_path, monkeypatch):
    monkeypatch.setenv("MMCAST_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, last in ((a, b"\x01"), (b, b"\x02")):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        _big_weights(folder / "model.safetensors", last)
    assert model_fingerprint(a) != model_fingerprint(b)


def test_weight_digests_are_reused_until_the_file_changes(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    import common.hashing as hashing

    cache = tmp_path / "cache"
    monkeypatch.setenv("MMCAST_CACHE_DIR", str(cache))
    hashed = []
    real = hashing._file_sha256
    monkeypatch.setattr(hashing, "_file_sha256", lambda p: hashed.append(p.name) or real(p))
    model = tmp_path / "m"
    model.mkdir()
    save_file({"w": torch.zeros(8)}, model / "model-1.safetensors")
    save_file({"w": torch.ones(8)}, model / "model-2.safetensors")
    assert model_fingerprint(model) and sorted(hashed) == ["model-1.safetensors", "model-2.safetensors"]
    hashed.clear()
    assert model_fingerprint(model) and len(hashed) == 2  # just written: never trusted to the cache
    assert not (cache / "weight-digests.json").exists()
    for path in model.iterdir():
        os.utime(path, ns=(time.time_ns() - 10**10,) * 2)  # written 10 s ago
    hashed.clear()
    first = model_fingerprint(model)
    assert sorted(hashed) == ["model-1.safetensors", "model-2.safetensors"]
    assert (cache / "weight-digests.json").is_file()

    hashing._digests.clear()  # a restarted process: the sidecar alone answers
    hashed.clear()
    assert model_fingerprint(model) == first and hashed == []

    save_file({"w": torch.full((8,), 2.0)}, model / "model-2.safetensors")  # a new file: new identity, rehashed
    changed = model_fingerprint(model)
    assert hashed == ["model-2.safetensors"] and changed != first

    hashing._digests.clear()
    hashed.clear()
    assert model_fingerprint(model, persist=False) == changed  # no cache at all: every file hashed, same answer
    assert sorted(hashed) == ["model-1.safetensors", "model-2.safetensors"]


def test_an_unwritable_cache_directory_only_costs_the_cache(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MMCAST_CACHE_DIR", str(blocker / "cache"))
    save_file({"w": torch.zeros(4)}, tmp_path / "model.safetensors")
    assert model_fingerprint(tmp_path) == model_fingerprint(tmp_path, persist=False)
