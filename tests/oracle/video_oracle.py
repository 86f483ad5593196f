"""What transformers itself gives a video file: the reference the video tests compare mmcast with.

Runs INSIDE the oracle venv (``scripts/install-oracle-venv.sh``: transformers 5.24 with torchvision's Python part),
never in the product venv, and imports nothing of mmcast. Reads one JSON request on stdin, prints one JSON answer:

    {"mode": "preprocess" | "generate", "model_dir": ..., "out_dir": ...,
     "max_new_tokens": 4,                              # generate only
     "cases": [{"video": path, "options": {...}, "attributes": {...}, "prompt": "Describe." | null,
                "model_dir": ... (optional: another model folder for this case; preprocess only)}, ...]}

A case may give a whole conversation instead of ``video`` and ``prompt``: ``"messages"`` (chat messages as
transformers' chat templates take them, ``{"type": "video"}`` marking each video) with ``"videos"`` (their files, in
order; each with a frame count in its header). ``input_ids`` are then the conversation's with the generation prompt.

``options`` are the processor call's video keyword arguments as a user passes them (``fps``, ``num_frames``,
``min_frames``, ``max_frames``, ``size``...); ``attributes`` are set on the video processor before the call (what a
checkpoint's ``video_preprocessor_config.json`` would say; Qwen3-VL's ``sample_frames`` reads ``min_frames`` and
``max_frames`` only from there). Each case answers, or gives ``{"error": "Type: message"}`` where transformers raises:

- ``preprocess``: ``AutoProcessor.from_pretrained(model_dir)`` (with torchvision present it builds the video
  processor) on the file path: ``pixel_values_videos`` saved as ``<out_dir>/<i>.npy`` (float32), ``video_grid_thw``,
  ``second_per_grid_ts`` (Qwen2.5-VL), the sampled ``frames_indices``, the metadata the loader read, and with a
  prompt the ``input_ids`` of the chat turn ``[video, prompt]`` with the generation prompt (its text too).
- ``live``: a live session (``"keep_turns"``, ``"turns"``: ``[{"video": path, "question": str}, ...]``, with the
  request's ``options``/``attributes``), as the scheduler's live sessions define one and computed here with
  transformers alone: each turn's new tokens (the previous answer's last token, the template's end of turn, the new
  user message rendered by the chat template and expanded by the processor with its video) get ``get_rope_index``
  positions over those tokens alone, offset to continue the session's; they run on transformers' own KV cache of the
  session, from which the evicted turns' entries are cut; ``max_new_tokens`` greedy tokens and log-probabilities per
  turn, with the retained prompt length and the next position.
- ``generate``: the same inputs, then ``AutoModelForImageTextToText.from_pretrained(model_dir)`` greedy generation of
  exactly ``max_new_tokens`` tokens (``min_new_tokens`` keeps the end tokens away) with each token's log-probability.

Decoding. ``processor(videos=path)`` decodes with torchcodec by default (``fetch_videos``), and without it falls
back to torchvision's video reader, which torchvision removed in 0.26: with neither the call raises ImportError.
The loader here is therefore ``load_video``'s own default backend, ``pyav`` (``read_video_pyav``): metadata from the
header (``stream.frames``, ``stream.average_rate``), frames decoded in order and the sampled ones converted with
``frame.to_ndarray(format="rgb24")``. Where the header has no frame count (``stream.frames`` 0: WebM, Matroska)
``read_video_pyav`` fails (it divides by zero while sampling); for those files the oracle decodes every frame the
same way and hands the processor the frames with metadata of the decoded count (the processor's own sampling of
an array input) - the count a loader can only know by decoding.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _use_pyav_loader() -> None:
    from transformers import video_processing_utils
    from transformers.video_utils import load_video

    def fetch_videos(self, video_url_or_urls, sample_indices_fn=None):
        if isinstance(video_url_or_urls, list):
            loaded = [fetch_videos(self, x, sample_indices_fn=sample_indices_fn) for x in video_url_or_urls]
            return list(zip(*loaded, strict=True))
        return load_video(video_url_or_urls, backend="pyav", sample_indices_fn=sample_indices_fn)

    video_processing_utils.VideoProcessorMixin.fetch_videos = fetch_videos


def _header(path: str) -> dict:
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        return {"frames": int(stream.frames), "fps": float(stream.average_rate) if stream.average_rate else None}


def _decoded(path: str):
    """Every frame as transformers' pyav loader converts one, with metadata of the decoded count."""
    import av
    import numpy as np
    import torch
    from transformers.video_utils import VideoMetadata

    with av.open(path) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        fps = float(stream.average_rate)
        meta = VideoMetadata(
            total_num_frames=len(frames),
            fps=fps,
            duration=len(frames) / fps,
            video_backend="pyav",
            height=stream.height,
            width=stream.width,
        )
    return torch.from_numpy(np.stack(frames)), meta


def _conversation(processor, case: dict, options: dict):
    text = processor.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], videos=list(case["videos"]), return_tensors="pt", **options)
    return out, text, {}


def _inputs(processor, case: dict):
    options = dict(case.get("options") or {})
    if "messages" in case:
        for name, value in (case.get("attributes") or {}).items():
            setattr(processor.video_processor, name, value)
        return _conversation(processor, case, options)
    video = case["video"]
    for name, value in (case.get("attributes") or {}).items():
        setattr(processor.video_processor, name, value)
    if "size" in options:  # a partial size override keeps the processor's other bound
        options["size"] = {**dict(processor.video_processor.size), **options["size"]}
    header = _header(video)
    if header["frames"] == 0:
        frames, meta = _decoded(video)
        videos, extra = [frames], {"video_metadata": [meta]}
    else:
        videos, extra = [video], {}
    picked = []  # the indices sample_frames returns (observed, not changed)
    sample_frames = processor.video_processor.sample_frames

    def recording(*args, **kwargs):
        indices = sample_frames(*args, **kwargs)
        picked.append([int(i) for i in list(indices)])
        return indices

    processor.video_processor.sample_frames = recording  # an instance attribute: removed again below
    prompt = case.get("prompt")
    text = None
    try:
        if prompt is not None:
            messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}]
            text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            out = processor(text=[text], videos=videos, return_tensors="pt", **options, **extra)
        else:
            out = processor.video_processor(videos, return_tensors="pt", return_metadata=True, **options, **extra)
    finally:
        del processor.video_processor.sample_frames
    header["frames_indices"] = picked[-1] if picked else None
    return out, text, header


def _preprocess(processor, case: dict, index: int, out_dir: str) -> dict:
    import numpy as np

    out, text, header = _inputs(processor, case)
    pixels = out["pixel_values_videos"].numpy()
    path = os.path.join(out_dir, f"{index}.npy")
    np.save(path, pixels)
    result = {
        "pixel_values_videos": path,
        "shape": list(pixels.shape),
        "dtype": str(pixels.dtype),
        "video_grid_thw": out["video_grid_thw"].tolist(),
        "header": header,
        "frames_indices": header.pop("frames_indices"),
    }
    if "second_per_grid_ts" in out:
        value = out["second_per_grid_ts"]
        result["second_per_grid_ts"] = [float(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]
    if text is not None:
        result["text"] = text
        result["input_ids"] = out["input_ids"][0].tolist()
    return result


def _generate(processor, model, case: dict, max_new_tokens: int) -> dict:
    import torch

    out, text, _ = _inputs(processor, case)
    inputs = {k: v for k, v in out.items() if k != "video_metadata"}
    with torch.no_grad():
        gen = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    prompt_len = inputs["input_ids"].shape[1]
    tokens = gen.sequences[0, prompt_len:].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), dim=-1)[token]) for step, token in zip(gen.logits, tokens, strict=True)
    ]
    return {"input_ids": inputs["input_ids"][0].tolist(), "text": text, "tokens": tokens, "logprobs": logprobs}


class _LiveSession:
    """A live session as transformers alone computes it: retained token ids, their (3, L) positions, the KV cache."""

    def __init__(self, processor, model, keep_turns: int, options: dict) -> None:
        self.processor, self.model, self.keep, self.options = processor, model, keep_turns, options
        self.user = {"role": "user", "content": [{"type": "text", "text": "u"}]}
        self.before = processor.apply_chat_template([self.user, {"role": "assistant", "content": "a"}], tokenize=False)
        self.close = processor.tokenizer(self.before[self.before.rfind("a") + 1 :])["input_ids"]
        self.tokens: list[int] = []
        self.turns: list[int] = []  # where each kept turn starts in ``tokens``
        self.cache = None
        self.cached = 0  # tokens whose KV the cache holds (the last answer token is sampled, not computed)
        self.next_position = 0  # the position of the first token not computed yet

    def _rope(self, ids: list[int], out):
        import inspect

        import torch

        config = self.model.config
        input_ids = torch.tensor([ids])
        types = torch.zeros_like(input_ids)
        types[input_ids == config.image_token_id] = 1
        types[input_ids == config.video_token_id] = 2
        kwargs = {"video_grid_thw": out["video_grid_thw"]}
        if "second_per_grid_ts" in inspect.signature(self.model.model.get_rope_index).parameters:
            kwargs["second_per_grid_ts"] = out.get("second_per_grid_ts")
        positions, _ = self.model.model.get_rope_index(input_ids, types, **kwargs)
        return positions + self.next_position  # (3, 1, L)

    def turn(self, video: str, question: str, n: int) -> dict:
        import torch

        render = self.processor.apply_chat_template
        message = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}
        dummy = [self.user, {"role": "assistant", "content": "a"}]
        after = render([*dummy, message], tokenize=False, add_generation_prompt=True)
        assert after.startswith(self.before)
        text = after[len(self.before) :]  # the new user message and the generation prompt
        if not self.turns:
            whole = render([message], tokenize=False, add_generation_prompt=True)
            lead = self.processor.tokenizer(whole[: len(whole) - len(text)])["input_ids"]  # the default system prompt
        else:
            lead = self.close[1:] if self.tokens[-1] == self.close[0] else self.close
            evict = len(self.turns) + 1 - self.keep
            if evict > 0:  # the oldest turns leave the KV; the kept rows keep their positions
                a = self.turns[0]
                b = self.turns[evict] if evict < len(self.turns) else len(self.tokens)
                if evict == len(self.turns):
                    lead = []  # nothing of the previous answer stays, nor its end of turn
                del self.tokens[a:b]
                for layer in self.cache.layers:
                    layer.keys = torch.cat([layer.keys[:, :, :a], layer.keys[:, :, min(b, self.cached) :]], 2)
                    layer.values = torch.cat([layer.values[:, :, :a], layer.values[:, :, min(b, self.cached) :]], 2)
                self.cached -= min(b, self.cached) - a
                self.turns = [t - (b - a) for t in self.turns[evict:]]
        out = self.processor(text=[text], videos=[video], return_tensors="pt", **self.options)
        turn_ids = out["input_ids"][0].tolist()
        self.turns.append(len(self.tokens) + len(lead))
        self.tokens += lead + turn_ids
        feed = self.tokens[self.cached :]  # the previous answer's last token, the end of turn, the new message
        positions = self._rope(feed, out)
        extra = {k: out[k] for k in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts") if k in out}
        prompt_tokens, tokens, logprobs = len(self.tokens), [], []
        with torch.no_grad():
            for _ in range(n):
                past = self.cache.get_seq_length() if self.cache is not None else 0
                result = self.model(
                    input_ids=torch.tensor([feed]),
                    position_ids=positions,
                    past_key_values=self.cache if self.cache is not None else _dynamic_cache(),
                    cache_position=torch.arange(past, past + len(feed)),
                    use_cache=True,
                    **extra,
                )
                self.cache, extra = result.past_key_values, {}
                logits = result.logits[0, -1].float()
                token = int(logits.argmax())
                tokens.append(token)
                logprobs.append(float(torch.log_softmax(logits, -1)[token]))
                nxt = int(positions.max()) + 1
                feed, positions = [token], torch.full((3, 1, 1), nxt, dtype=positions.dtype)
        self.cached = len(self.tokens) + n - 1
        self.tokens += tokens
        self.next_position = int(positions.max())  # the last answer token's, not computed yet
        return {
            "tokens": tokens,
            "logprobs": logprobs,
            "prompt_tokens": prompt_tokens,
            "next_position": self.next_position,
        }


def _dynamic_cache():
    from transformers import DynamicCache

    return DynamicCache()


def _live(processor, model, case: dict, max_new_tokens: int) -> dict:
    for name, value in (case.get("attributes") or {}).items():
        setattr(processor.video_processor, name, value)
    session = _LiveSession(processor, model, int(case["keep_turns"]), dict(case.get("options") or {}))
    return {"turns": [session.turn(t["video"], t["question"], max_new_tokens) for t in case["turns"]]}


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    request = json.load(sys.stdin)
    _use_pyav_loader()
    from transformers import AutoProcessor
    from transformers.utils import logging

    logging.set_verbosity_error()
    mode = request.get("mode", "preprocess")
    out_dir = request.get("out_dir") or "."
    os.makedirs(out_dir, exist_ok=True)
    model = None
    if mode in ("generate", "live"):
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(request["model_dir"]).eval()
    results = []
    processors = {}  # model_dir -> a processor no case has changed
    for index, case in enumerate(request["cases"]):
        model_dir = case.get("model_dir") or request["model_dir"]
        if case.get("attributes"):  # a fresh one: attributes are per case
            processor = AutoProcessor.from_pretrained(model_dir)
        else:
            processor = processors.get(model_dir) or processors.setdefault(
                model_dir, AutoProcessor.from_pretrained(model_dir)
            )
        try:
            if mode == "live":
                results.append(_live(processor, model, case, int(request.get("max_new_tokens", 4))))
            elif mode == "generate":
                results.append(_generate(processor, model, case, int(request.get("max_new_tokens", 4))))
            else:
                results.append(_preprocess(processor, case, index, out_dir))
        except Exception as exc:  # noqa: BLE001 - the answer names what transformers raised
            results.append({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]})
    versions = {}
    import torch
    import torchvision
    import transformers

    versions = {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "transformers": transformers.__version__,
    }
    json.dump({"results": results, "versions": versions}, sys.stdout)


if __name__ == "__main__":
    main()
