"""The scheduler's limits on requests and on the media URLs of the OpenAI API: the first part of
``SchedulerConfig`` (config.py), which checks them with the rest."""

from __future__ import annotations

import dataclasses

from common import tls_settings
from common.settings import setting

INT_MAX = 2**63 - 1
# Pillow format names the frontend opens by default; every other plugin (ICO, TIFF, PSD, ...) never runs.
DEFAULT_IMAGE_FORMATS = ["JPEG", "PNG", "WEBP", "GIF", "BMP"]
# The default --max-prompt-bytes is the context times this: the most text bytes one token may stand for in a prompt
# that still fits. Measured on the shipped byte-level BPE (docs/SECURITY.md section 5): English prose 3.3
# bytes/token, random CJK, emoji, printable ASCII and random bytes 1.0; subword tokenizers of real checkpoints
# reach ~4-5 on English and ~4.5 on CJK (1.5 characters of 3 bytes per token). 8 leaves room above all of them.
PROMPT_BYTES_PER_TOKEN = 8
# --help sections
LIMITS, CACHES, BATCHING = "model and request limits", "caches", "batching"
WIRE, SERVICE, SECURITY = "transfer to the ranks", "service", tls_settings.SECURITY
MEDIA = "image URLs (OpenAI API; docs/SECURITY.md)"


@dataclasses.dataclass
class RequestLimits:
    """What one request may ask for and carry, and which image URLs the OpenAI API loads."""

    # --- model and limits on requests -------------------------------------------------------------------------
    model: str = setting(
        "",
        "model folder (config, weights, tokenizer, processor); the ranks must load the same one",
        section=LIMITS,
        metavar="DIR",
    )
    max_model_len: int = setting(
        0,
        "context length: prompt + max_tokens must fit (0 = the model config's, capped by the ranks')",
        min=0,
        section=LIMITS,
    )
    max_tokens_limit: int = setting(
        0,
        "largest sampling.max_tokens a request may ask for, an operator's cap below the context (0 = the context "
        "alone: prompt + max_tokens must fit it)",
        min=0,
        max=2**31 - 1,
        section=LIMITS,
    )
    max_choices: int = setting(
        8,
        "largest n (choices of one prompt) an OpenAI API request may ask for; each choice is a request of its own",
        min=1,
        max=1024,
        section=LIMITS,
    )
    max_logprobs: int = setting(
        20,
        "largest sampling.logprobs (top alternatives per token) a request may ask for",
        min=0,
        max=1024,
        section=LIMITS,
    )
    max_grammar_bytes: int = setting(
        65536,
        "bytes of one request's structured-output grammar (a JSON schema, a regex, a choice list, the tools' schemas)",
        min=16,
        max=16 * 2**20,
        section=LIMITS,
    )
    max_images_per_request: int = setting(64, "images one request may contain", min=0, max=100_000, section=LIMITS)
    response_store_entries: int = setting(
        4096,
        "/v1/responses answers kept for previous_response_id (all tenants; least recently used go first)",
        min=1,
        max=10_000_000,
        section=CACHES,
    )
    response_store_bytes: int = setting(
        64 << 20,
        "text bytes of the conversations kept for previous_response_id (media stay in the upload store)",
        min=1024,
        max=2**40,
        section=CACHES,
    )
    max_prompts_per_request: int = setting(
        32, "prompts one /v1/completions request may list (one choice each)", min=1, max=4096, section=LIMITS
    )
    max_image_pixels: int = setting(
        33_554_432,
        "width * height of one image, checked on the header before decoding (decompression bombs)",
        min=1,
        max=2**40,
        section=LIMITS,
    )
    max_videos_per_request: int = setting(8, "videos one request may contain", min=0, max=10_000, section=LIMITS)
    max_video_frames: int = setting(
        256,
        "frames one video may sample (each frame costs a decode and its patches); caps every fps/num_frames request",
        min=1,
        max=65_536,
        section=LIMITS,
    )
    max_video_seconds: float = setting(
        3600.0, "duration of one video, from its container header", min=0.001, max=10**7, section=LIMITS
    )
    max_video_total_frames: int = setting(
        1_000_000, "frames in one video's stream, from its container header", min=1, max=2**40, section=LIMITS
    )
    max_video_frame_pixels: int = setting(
        3840 * 2160,
        "width * height of one video frame, from the container header before any frame is decoded",
        min=1,
        max=2**40,
        section=LIMITS,
    )
    max_video_streams: int = setting(
        16, "streams (video, audio, subtitles, data) one container may hold", min=1, max=10_000, section=LIMITS
    )
    max_upload_bytes: int = setting(
        32 << 20, "bytes of one encoded image (inline or uploaded)", min=1, max=INT_MAX, section=LIMITS
    )
    max_request_bytes: int = setting(
        64 << 20,
        "bytes of one serialized GenerateRequest (also the gRPC receive limit)",
        min=1024,
        max=2**31 - 1,
        section=LIMITS,
    )
    max_prompt_bytes: int = setting(
        0,
        f"UTF-8 bytes of all text parts of one request, checked before tokenizing (0 = the context length x "
        f"{PROMPT_BYTES_PER_TOKEN})",
        min=0,
        max=2**31 - 1,
        section=LIMITS,
    )
    image_formats: list = setting(
        DEFAULT_IMAGE_FORMATS,
        "image formats the frontend opens (Pillow names, comma separated on the CLI); no other decoder ever runs",
        section=LIMITS,
    )
    max_concurrent_decodes: int = setting(
        2,
        "images the frontend decodes and preprocesses at once under --payload-encoding pixels (each may hold "
        "~1.4 GiB at the default limits: docs/SECURITY.md; under encoded the ranks decode)",
        min=1,
        max=1024,
        section=LIMITS,
    )
    frontend_threads: int = setting(
        4,
        "threads that check, decode and tokenize requests off the event loop (each has its own tokenizer)",
        min=1,
        max=1024,
        section=LIMITS,
    )
    max_pending_upload_bytes: int = setting(
        128 << 20,
        "bytes held by unfinished uploads, all tenants together; more get RESOURCE_EXHAUSTED",
        min=1,
        max=INT_MAX,
        section=LIMITS,
    )
    max_pending_upload_bytes_per_tenant: int = setting(
        64 << 20,
        "bytes held by one tenant's unfinished uploads; more get RESOURCE_EXHAUSTED",
        min=1,
        max=INT_MAX,
        section=LIMITS,
    )

    # --- image URLs of the OpenAI API (scheduler_svc/doors/media_urls.py); everything off but data: URLs by default -----
    allowed_media_domains: list = setting(
        [],
        "host names whose http(s) image URLs may be fetched (comma separated; 'media.example.com' matches that "
        "host exactly, '*.example.com' its subdomains; empty = remote image URLs refused)",
        section=MEDIA,
        metavar="HOST,...",
    )
    allowed_local_media_path: str = setting(
        "",
        "directory whose files file:// image URLs may read (symlinks and '..' out of it refused; empty = file "
        "URLs refused)",
        section=MEDIA,
        metavar="DIR",
    )
    allowed_media_networks: list = setting(
        [],
        "CIDRs image fetches may reach although they are loopback, private, link-local or reserved (in-cluster "
        "media servers, tests); nothing else non-public is ever connected to",
        section=MEDIA,
        metavar="CIDR,...",
    )
    media_fetch_timeout_seconds: float = setting(
        10.0,
        "time one image URL fetch may take in all: resolving, connecting, redirects and the body",
        min=0.001,
        max=3600.0,
        section=MEDIA,
    )
    media_fetch_max_redirects: int = setting(
        3, "redirects one image URL fetch follows (each hop checked again)", min=0, max=20, section=MEDIA
    )
