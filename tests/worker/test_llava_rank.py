"""The rank's family-driven paths on the tiny LLaVA (no grid, no M-RoPE): what it checks of an item before the
encoder runs, and the 1-D positions it admits a request with. The oracle tests (test_oracle.py) show the answers;
these show the rank refuses what the LLaVA tower cannot take, naming the field and the shape it needs."""

from __future__ import annotations

import dataclasses

import torch

from common import item_proto
from common.multimodal import ENCODED_FIELD, MultiModalFieldElem, MultiModalKwargsItem, PayloadEncoding
from mmcast.v1 import worker_pb2
from tests.support.worker_driver import noise_image
from worker_svc.request_state import admit


def _prompt(env):
    return env.prompt([noise_image(3, 112, 84), "What is this and", noise_image(4, 30, 200), "that?"])


def _with_pixels(feature, pixels, encoding=PayloadEncoding.PIXELS):
    name = ENCODED_FIELD if encoding is PayloadEncoding.ENCODED else "pixel_values"
    return dataclasses.replace(
        feature, data=MultiModalKwargsItem({name: MultiModalFieldElem(pixels)}), encoding=encoding
    )


def test_runner_takes_llava_items_without_a_grid(worker_env_for):
    env = worker_env_for("llava")
    runner = env.rank.worker.runner
    assert (runner.family.name, runner.uses_mrope, runner.rope_kwargs) == ("llava", False, {})
    assert runner.row_width == runner.hidden == 128
    feature = _prompt(env).features[0]
    assert list(feature.data) == ["pixel_values"]
    assert runner.encoder_fields(feature) == ("pixel_values",)
    assert runner.encoder_input_problem(feature) is None
    assert tuple(runner.encode(feature).shape) == (9, 128)


def test_rank_refuses_pixels_the_llava_tower_cannot_take(worker_env_for):
    env = worker_env_for("llava")
    runner = env.rank.worker.runner
    feature = _prompt(env).features[0]
    for bad in (
        torch.zeros(1, 3, 28, 28),
        torch.zeros(2, 3, 42, 42),
        torch.zeros(9, 588),
        torch.zeros(1, 3, 42, 42, dtype=torch.int64),
    ):
        problem = runner.encoder_input_problem(_with_pixels(feature, bad))
        assert problem is not None and "pixel_values" in problem and "(1, 3, 42, 42)" in problem, (bad.shape, problem)
    encoded = _with_pixels(feature, torch.zeros(4, 4, dtype=torch.uint8), PayloadEncoding.ENCODED)
    assert runner.encoder_fields(encoded) == (ENCODED_FIELD,)
    assert "1-D uint8" in runner.encoder_input_problem(encoded)


def test_admitted_llava_request_has_1d_positions(worker_env_for):
    env = worker_env_for("llava")
    prompt = _prompt(env)
    msg = worker_pb2.NewRequest(
        request_id="r",
        prompt_token_ids=prompt.token_ids,
        block_ids=list(range(8)),
        num_scheduled_tokens=len(prompt.token_ids),
    )
    msg.mm_items.extend(item_proto.feature_to_proto(f) for f in prompt.features)
    state = admit(msg, vocab_size=1024, num_blocks=64, block_size=16, max_model_len=4096, rope_kwargs=None)
    n = len(prompt.token_ids)
    assert torch.equal(state.positions, torch.arange(n).reshape(1, n))
    assert torch.equal(state.window_positions(n - 3, n + 2), torch.arange(n - 3, n + 2).reshape(1, 5))
