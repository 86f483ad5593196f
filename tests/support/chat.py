"""Small builders for GenerationService requests and a unary-style generate over the stream (service tests)."""

from __future__ import annotations

import io

from PIL import Image

from mmcast.v1 import generation_pb2 as g


def png(color, size=(56, 56)):
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


IMG_A, IMG_B, IMG_C = png((200, 30, 30)), png((30, 200, 30), (84, 56)), png((30, 30, 200))


def image(data):
    return g.ContentPart(image=g.ImageInput(data=data))


def text(t):
    return g.ContentPart(text=t)


def user(*parts):
    return g.ChatMessage(role=g.ROLE_USER, content=list(parts))


def request(messages, max_tokens=6, **kw):
    return g.GenerateRequest(messages=messages, sampling=g.SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw)


def generate(stub, req, timeout=30):
    tokens, final = [], None
    for resp in stub.Generate(req, timeout=timeout):
        if resp.HasField("delta"):
            tokens.extend(resp.delta.token_ids)
        else:
            final = resp.final
    return tokens, final
