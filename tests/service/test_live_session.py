"""Live sessions end to end: a real TP=2 group (the suite's shared serve-local group) keeps a conversation's KV
between turns and evicts its oldest turns in place (scheduler_svc/core/live_sessions.py).

The reference is plain transformers fed the tokens the session retains with explicit position ids: each turn's
tokens are the chat template's rendering of its messages after an assistant turn, tokenized by the model's own
processor, at the positions the session gave them when they were first computed (the kept turns keep theirs after
an eviction; new tokens continue after the largest). Greedy tokens and log-probabilities of every turn, before and
after evictions, must match; a negative control shows that the same tokens at fresh positions (a re-sent
conversation) give other log-probabilities, so the comparison can fail.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from transformers import DynamicCache

from mmcast.v1 import generation_pb2, generation_pb2_grpc
from tests.support.oracle import LOGPROB_TOLERANCE, Oracle

pytestmark = pytest.mark.slow
N = 5
QUESTIONS = ["What do you see now?", "And now, anything new?", "Still the same scene?", "Describe the last part."]


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    return Oracle(tiny_model_dir)


@pytest.fixture(scope="module")
def stub(serve_local_tp2):
    with grpc.insecure_channel(serve_local_tp2.target) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def turn(stub, session: str, question: str, keep: int, *, request_id: str = "", close: bool = False):
    req = generation_pb2.GenerateRequest(
        request_id=request_id,
        messages=[
            generation_pb2.ChatMessage(
                role=generation_pb2.ROLE_USER, content=[generation_pb2.ContentPart(text=question)]
            )
        ],
        sampling=generation_pb2.SamplingParams(max_tokens=N, ignore_eos=True, return_logprobs=True),
        live=generation_pb2.LiveSession(session_id=session, keep_turns=keep, close=close),
    )
    tokens, logprobs, final = [], [], None
    for resp in stub.Generate(req, timeout=120):
        if resp.HasField("delta"):
            tokens += list(resp.delta.token_ids)
            logprobs += [lp.logprob for lp in resp.delta.logprobs]
        else:
            final = resp.final
    return tokens, logprobs, final


class Reference:
    """The session as plain transformers sees it: retained token ids with their positions, turn by turn."""

    def __init__(self, oracle: Oracle, keep: int) -> None:
        self.oracle, self.keep = oracle, keep
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.turns: list[int] = []  # where each kept turn starts
        self.next_position = 0
        render = oracle.processor.apply_chat_template
        user = {"role": "user", "content": [{"type": "text", "text": "u"}]}
        answer = {"role": "assistant", "content": [{"type": "text", "text": "a"}]}
        self.before = render([user, answer], tokenize=False)
        self.close = oracle.processor.tokenizer(self.before[self.before.rfind("a") + 1 :])["input_ids"]
        self.dummy = [user, answer]
        self.cache, self.cached = None, 0  # transformers' KV cache of the session, and how many tokens it holds

    def _ids(self, text: str) -> list[int]:
        return self.oracle.processor.tokenizer(text)["input_ids"]

    def add_turn(self, question: str) -> None:
        render = self.oracle.processor.apply_chat_template
        message = {"role": "user", "content": [{"type": "text", "text": question}]}
        after = render([*self.dummy, message], tokenize=False, add_generation_prompt=True)
        assert after.startswith(self.before)
        turn_ids = self._ids(after[len(self.before) :])
        if not self.turns:
            whole = render([message], tokenize=False, add_generation_prompt=True)
            lead = self._ids(whole[: len(whole) - (len(after) - len(self.before))])  # the default system prompt
        else:
            lead = self.close[1:] if self.tokens[-1] == self.close[0] else self.close
            evict = len(self.turns) + 1 - self.keep
            if evict > 0:  # the oldest turns go; the others keep their positions
                a = self.turns[0]
                b = self.turns[evict] if evict < len(self.turns) else len(self.tokens)
                if evict == len(self.turns):
                    lead = []  # nothing of the previous answer stays, nor its end of turn
                del self.tokens[a:b], self.positions[a:b]
                self.evict_cache(a, min(b, self.cached))
                self.turns = [t - (b - a) for t in self.turns[evict:]]
        start = len(self.tokens) + len(lead)
        new = lead + turn_ids
        self.tokens += new
        self.positions += list(range(self.next_position, self.next_position + len(new)))
        self.next_position += len(new)
        self.turns.append(start)

    def answer(self, recompute: bool = False) -> tuple[list[int], list[float]]:
        """Greedy tokens and log-probabilities from transformers' own KV cache, which holds what the session holds:
        the tokens it computed, with the evicted turns' entries cut out (``evict_cache``); the new tokens go in with
        their explicit positions. ``recompute``: the retained tokens run again from scratch at their positions
        instead (what a re-sent conversation of those tokens would give: the kept turns' KV would no longer carry
        the evicted turns' context), the negative control."""
        if recompute:
            cache, feed, positions = None, list(self.tokens), list(self.positions)
        else:
            cache = self.cache
            feed, positions = self.tokens[self.cached :], self.positions[self.cached :]
        out, logprobs = [], []
        with torch.inference_mode():
            for _ in range(N):
                past = cache.get_seq_length() if cache is not None else 0
                result = self.oracle.model(
                    input_ids=torch.tensor([feed]),
                    position_ids=torch.tensor(positions).reshape(1, 1, -1).expand(3, 1, -1),
                    past_key_values=cache if cache is not None else DynamicCache(),
                    cache_position=torch.arange(past, past + len(feed)),
                    use_cache=True,
                )
                cache = result.past_key_values
                logits = result.logits[0, -1].float()
                token = int(logits.argmax())
                out.append(token)
                logprobs.append(float(torch.log_softmax(logits, -1)[token]))
                feed, positions = [token], [positions[-1] + 1]
        if not recompute:
            self.cache, self.cached = cache, len(self.tokens) + N - 1  # the last answer token is not in it yet
        return out, logprobs

    def evict_cache(self, a: int, b: int) -> None:
        for layer in self.cache.layers:
            layer.keys = torch.cat([layer.keys[:, :, :a], layer.keys[:, :, b:]], 2)
            layer.values = torch.cat([layer.values[:, :, :a], layer.values[:, :, b:]], 2)
        self.cached -= b - a

    def take_answer(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.positions += list(range(self.next_position, self.next_position + len(tokens)))
        self.next_position += len(tokens)


def test_live_session_keeps_kv_and_positions_through_evictions(stub, oracle):
    keep = 2
    ref = Reference(oracle, keep)
    for k, question in enumerate(QUESTIONS):
        ref.add_turn(question)
        want_tokens, want_logprobs = ref.answer()
        tokens, logprobs, final = turn(stub, "cam-1", question, keep, close=k == len(QUESTIONS) - 1)
        assert final.finish_reason == generation_pb2.FINISH_REASON_LENGTH, final.error.message
        got = (final.usage.prompt_tokens, final.live.next_position)
        assert got == (len(ref.tokens), ref.next_position + N - 1), f"turn {k}"
        assert tokens == want_tokens, f"turn {k}"
        assert logprobs == pytest.approx(want_logprobs, abs=LOGPROB_TOLERANCE), f"turn {k}"
        if k:
            # only the turn's own tokens are computed: the retained ones come from the session's KV
            assert final.usage.cached_tokens > 0 and final.usage.cached_tokens < final.usage.prompt_tokens
        assert final.live.evicted_turns == (1 if k >= keep else 0), f"turn {k}"
        assert final.live.closed == (k == len(QUESTIONS) - 1)
        if k == len(QUESTIONS) - 2:
            # negative control: the retained tokens computed again (without the evicted turns' context) differ
            _, fresh = ref.answer(recompute=True)
            assert max(abs(a - b) for a, b in zip(fresh, logprobs, strict=True)) > LOGPROB_TOLERANCE
        ref.take_answer(tokens)
    # closed with the last turn: the next turn of that name starts a new session from position 0
    tokens, _, final = turn(stub, "cam-1", QUESTIONS[0], keep, close=True)
    fresh = Reference(oracle, keep)
    fresh.add_turn(QUESTIONS[0])
    assert tokens == fresh.answer()[0]
    assert final.usage.cached_tokens == 0


def test_live_session_refusals_leave_the_session_as_it_was(stub, oracle):
    with pytest.raises(grpc.RpcError) as err:
        turn(stub, "bad id!", "hi", 2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "live.session_id" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        turn(stub, "cam-2", "hi", 100_000)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "live.keep_turns" in err.value.details()
    first, _, _ = turn(stub, "cam-2", QUESTIONS[0], 2)
    req = generation_pb2.GenerateRequest(
        messages=[
            generation_pb2.ChatMessage(
                role=generation_pb2.ROLE_ASSISTANT, content=[generation_pb2.ContentPart(text="x")]
            )
        ],
        sampling=generation_pb2.SamplingParams(max_tokens=N, ignore_eos=True),
        live=generation_pb2.LiveSession(session_id="cam-2", keep_turns=2),
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].role" in err.value.details()
    # the refused turn changed nothing: the next one continues the session as if it had not been sent
    ref = Reference(oracle, 2)
    ref.add_turn(QUESTIONS[0])
    ref.take_answer(first)
    ref.add_turn(QUESTIONS[1])
    tokens, logprobs, final = turn(stub, "cam-2", QUESTIONS[1], 2, close=True)
    assert tokens == ref.answer()[0]
    assert final.live.closed


def test_sdk_live_turns_with_one_kept_turn(serve_local_tp2, oracle):
    """Through the SDK (``live=``), keep_turns 1: every turn evicts all earlier turns and the last answer's tail,
    leaving the template's prefix and the new turn at continued positions."""
    from mmcast_client import Client

    ref = Reference(oracle, 1)
    with Client(serve_local_tp2.target) as client:
        for k, question in enumerate(QUESTIONS[:3]):
            ref.add_turn(question)
            want_tokens, want_logprobs = ref.answer()
            result = client.generate(
                [{"role": "user", "content": question}],
                max_tokens=N,
                ignore_eos=True,
                logprobs=0,
                session_id="sdk-1",
                live={"keep_turns": 1, "close": k == 2},
            )
            assert list(result.token_ids) == want_tokens, f"turn {k}"
            assert [t.logprob for t in result.logprobs] == pytest.approx(want_logprobs, abs=LOGPROB_TOLERANCE)
            assert result.live["evicted_turns"] == (1 if k else 0) and result.live["closed"] == (k == 2)
            ref.take_answer(list(result.token_ids))
