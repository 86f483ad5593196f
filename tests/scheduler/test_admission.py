"""The context limit: every stage that checks it (scheduler_svc/core/admission.py's CONTEXT_CHECKS, in the order a request
meets them) refuses with INVALID_ARGUMENT and the one message shape — the field(s), the prompt's tokens, the tokens
to generate, their sum, the limit, its flag and what to change."""

from __future__ import annotations

import asyncio
import re
import types

import pytest

from benchmarks.http_api import hostile_inputs as hostile
from common.errors import InvalidArgument
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import admission
from scheduler_svc.core.inputs import GroupBudget
from scheduler_svc.core.request import Request, RequestSampling
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine.completion import CompletionRequest, Completions
from scheduler_svc.engine.frontend import ChatTurn, Frontend, ImagePart, TextPart
from scheduler_svc.engine.request_input import SamplingSpec

SHAPE = re.compile(
    r"(?P<fields>.+?): (?:at least )?(?P<prompt>\d+) prompt tokens(?: \([^)]+\))? \+ (?P<generate>\d+) to generate "
    r"\((?:sampling\.max_tokens=(?P=generate)|at least one)\) = (?P<sum>\d+) tokens, over the context of "
    r"(?P<context>\d+) tokens \(--max-model-len / the model's max_position_embeddings\); send [^;]+"
)


def refusal(action) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        action()
    return info.value


def assert_shape(err: InvalidArgument, fields: tuple[str, ...], context: int, generate: int | None = None) -> dict:
    """The one shape, naming exactly the error's fields; returns the numbers it states."""
    assert err.status.value == "INVALID_ARGUMENT"
    assert tuple(err.fields) == fields, err.fields
    match = SHAPE.fullmatch(err.message)
    assert match, err.message
    numbers = {k: int(v) for k, v in match.groupdict().items() if k != "fields"}
    assert match["fields"] == " and ".join(fields), err.message
    assert numbers["sum"] == numbers["prompt"] + numbers["generate"] > numbers["context"] == context, err.message
    if generate is not None:
        assert numbers["generate"] == generate, err.message
    if admission.GENERATE_FIELD in fields and numbers["prompt"] < context:
        assert f"set sampling.max_tokens to at most {context - numbers['prompt']}" in err.message, err.message
    return numbers


def user(*parts):
    return [ChatTurn("user", list(parts))]


LONG = "the quick brown fox jumps over the lazy dog " * 40


@pytest.fixture(scope="module")
def frontend(tiny_model_dir):
    return Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels", max_model_len=1024))


def test_an_image_no_request_could_hold(frontend):  # check_image_fits
    err = refusal(lambda: frontend.check_image_header(hostile.solid_png(1000, 1000), "upload"))
    numbers = assert_shape(err, ("upload",), 1024, generate=1)
    assert "(the 1000x1000 image)" in err.message and numbers["prompt"] >= 1024


def test_images_with_the_tokens_to_generate_before_decoding(frontend):  # check_images_fit
    images = user(*[ImagePart(hostile.solid_png(504, 504, value=v)) for v in (1, 2, 3)], TextPart("Compare."))
    decoded = frontend.counts["images_decoded"]
    err = refusal(lambda: frontend.process(images, reserve_tokens=100))
    assert_shape(err, ("messages[0].content[2].image", admission.GENERATE_FIELD), 1024, generate=100)
    assert "at least " in err.message and "the 504x504 image takes" in err.message
    assert frontend.counts["images_decoded"] == decoded  # refused before any image was decoded


def test_the_tokenized_chat_prompt(frontend):  # check_prompt_fits, chat
    err = refusal(lambda: frontend.process(user(TextPart(LONG * 2))))
    assert_shape(err, ("messages",), 1024, generate=1)


def test_the_tokenized_text_prompt(frontend):  # check_prompt_fits, plain text
    err = refusal(lambda: frontend.process_text(LONG, reserve_tokens=900))
    assert_shape(err, ("prompt", admission.GENERATE_FIELD), 1024, generate=900)


def test_the_request_with_its_max_tokens(frontend):  # check_request_fits
    engine = types.SimpleNamespace(max_model_len=1024)
    completions = Completions(
        engine=engine, frontend=frontend, config=SchedulerConfig(), tokenizer=None, make_request=None
    )
    sampling = SamplingSpec(900, 0.0, 1.0, 0, None, (), (), False, 0, False)
    req = CompletionRequest("r", "", sampling, 0.0, turns=user(TextPart(LONG[:800])))
    try:
        err = refusal(lambda: asyncio.run(completions.admit(req)))
    finally:
        completions.executor.shutdown()
    assert_shape(err, ("messages", admission.GENERATE_FIELD), 1024, generate=900)


def core() -> Scheduler:
    group = GroupBudget(num_ranks=1, kv_blocks=256, encoder_cache_tokens=64, payload_cache_bytes=2048)
    return Scheduler(SchedulerConfig(max_model_len=512), group, uses_mrope=False, eos_token_ids={2})


def test_the_cores_own_guards():  # check_core_fits, check_max_tokens_fits
    err = refusal(lambda: core().add_request(Request("a", list(range(1, 513)), [], RequestSampling(max_tokens=4))))
    assert_shape(err, ("messages",), 512, generate=1)
    err = refusal(lambda: core().add_request(Request("b", list(range(1, 11)), [], RequestSampling(max_tokens=505))))
    assert_shape(err, (admission.GENERATE_FIELD,), 512, generate=505)
    assert "at most 502" in err.message


def test_every_stage_is_listed_in_order_and_tested():
    names = [check.__name__ for check in admission.CONTEXT_CHECKS]
    assert names == [
        "check_image_fits",
        "check_images_fit",
        "check_prompt_fits",
        "check_request_fits",
        "check_core_fits",
        "check_max_tokens_fits",
    ]
    source = open(__file__).read()
    for name in names:
        assert f"# {name}" in source or f", {name}" in source, name


def test_a_prompt_that_fits_passes_every_stage():
    for fields, prompt, generate in ((("messages",), 1023, 1), (("prompt", "sampling.max_tokens"), 24, 1000)):
        admission.check_context(fields, prompt, generate, 1024)
    admission.check_context("messages", 10**9, 1, 0)  # an unknown context (0) is not checked
