"""Block hashes, item identifiers and model fingerprints."""

import json

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
