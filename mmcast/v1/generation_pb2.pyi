import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from mmcast.v1 import logprob_pb2 as _logprob_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_SYSTEM: _ClassVar[Role]
    ROLE_USER: _ClassVar[Role]
    ROLE_ASSISTANT: _ClassVar[Role]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class TransferMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_MODE_UNSPECIFIED: _ClassVar[TransferMode]
    TRANSFER_MODE_FULL: _ClassVar[TransferMode]
    TRANSFER_MODE_STRIP: _ClassVar[TransferMode]
    TRANSFER_MODE_LAZY: _ClassVar[TransferMode]
ROLE_UNSPECIFIED: Role
ROLE_SYSTEM: Role
ROLE_USER: Role
ROLE_ASSISTANT: Role
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
TRANSFER_MODE_UNSPECIFIED: TransferMode
TRANSFER_MODE_FULL: TransferMode
TRANSFER_MODE_STRIP: TransferMode
TRANSFER_MODE_LAZY: TransferMode

class ImageInput(_message.Message):
    __slots__ = ("data", "uploaded_sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    uploaded_sha256: str
    def __init__(self, data: _Optional[bytes] = ..., uploaded_sha256: _Optional[str] = ...) -> None: ...

class VideoInput(_message.Message):
    __slots__ = ("data", "uploaded_sha256", "fps", "num_frames", "max_frames", "min_pixels", "max_pixels")
    DATA_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_SHA256_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    uploaded_sha256: str
    fps: float
    num_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int
    def __init__(self, data: _Optional[bytes] = ..., uploaded_sha256: _Optional[str] = ..., fps: _Optional[float] = ..., num_frames: _Optional[int] = ..., max_frames: _Optional[int] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image", "video")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: ImageInput
    video: VideoInput
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[ImageInput, _Mapping]] = ..., video: _Optional[_Union[VideoInput, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: Role
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "return_logprobs", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    return_logprobs: bool
    top_k: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., return_logprobs: _Optional[bool] = ..., top_k: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., bad_words: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "messages", "sampling", "cache_salt", "continue_final_message", "live", "structured_output")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    cache_salt: str
    continue_final_message: bool
    live: LiveSession
    structured_output: StructuredOutput
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., continue_final_message: _Optional[bool] = ..., live: _Optional[_Union[LiveSession, _Mapping]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class LiveSession(_message.Message):
    __slots__ = ("session_id", "keep_turns", "close")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_TURNS_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keep_turns: int
    close: bool
    def __init__(self, session_id: _Optional[str] = ..., keep_turns: _Optional[int] = ..., close: _Optional[bool] = ...) -> None: ...

class LiveSessionState(_message.Message):
    __slots__ = ("session_id", "turns", "tokens", "evicted_turns", "next_position", "closed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TURNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    turns: int
    tokens: int
    evicted_turns: int
    next_position: int
    closed: bool
    def __init__(self, session_id: _Optional[str] = ..., turns: _Optional[int] = ..., tokens: _Optional[int] = ..., evicted_turns: _Optional[int] = ..., next_position: _Optional[int] = ..., closed: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_logprob_pb2.TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_logprob_pb2.TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "images", "images_sent", "images_stripped", "images_rank_cached", "payload_bytes_broadcast", "payload_bytes_saved", "preemptions", "encoder_runs", "encoder_output_bytes_shared", "image_cpu_time", "images_encoder_shared", "videos")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_STRIPPED_FIELD_NUMBER: _ClassVar[int]
    IMAGES_RANK_CACHED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_BROADCAST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_SAVED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_RUNS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_OUTPUT_BYTES_SHARED_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CPU_TIME_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODER_SHARED_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    images: int
    images_sent: int
    images_stripped: int
    images_rank_cached: int
    payload_bytes_broadcast: int
    payload_bytes_saved: int
    preemptions: int
    encoder_runs: int
    encoder_output_bytes_shared: int
    image_cpu_time: _duration_pb2.Duration
    images_encoder_shared: int
    videos: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., images: _Optional[int] = ..., images_sent: _Optional[int] = ..., images_stripped: _Optional[int] = ..., images_rank_cached: _Optional[int] = ..., payload_bytes_broadcast: _Optional[int] = ..., payload_bytes_saved: _Optional[int] = ..., preemptions: _Optional[int] = ..., encoder_runs: _Optional[int] = ..., encoder_output_bytes_shared: _Optional[int] = ..., image_cpu_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., images_encoder_shared: _Optional[int] = ..., videos: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("time_to_first_token", "total_time", "queue_time")
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token: _duration_pb2.Duration
    total_time: _duration_pb2.Duration
    queue_time: _duration_pb2.Duration
    def __init__(self, time_to_first_token: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., total_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., queue_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class GenerateError(_message.Message):
    __slots__ = ("grpc_code", "message")
    GRPC_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    grpc_code: int
    message: str
    def __init__(self, grpc_code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "usage", "timings", "request_id", "stop_reason", "error", "live")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    request_id: str
    stop_reason: str
    error: GenerateError
    live: LiveSessionState
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[str] = ..., stop_reason: _Optional[str] = ..., error: _Optional[_Union[GenerateError, _Mapping]] = ..., live: _Optional[_Union[LiveSessionState, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: TokenDelta
    final: GenerateFinal
    def __init__(self, delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ...) -> None: ...

class UploadImageRequest(_message.Message):
    __slots__ = ("data", "expected_sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    expected_sha256: str
    def __init__(self, data: _Optional[bytes] = ..., expected_sha256: _Optional[str] = ...) -> None: ...

class UploadImageResponse(_message.Message):
    __slots__ = ("sha256", "byte_size", "already_present")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    byte_size: int
    already_present: bool
    def __init__(self, sha256: _Optional[str] = ..., byte_size: _Optional[int] = ..., already_present: _Optional[bool] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("model", "model_fingerprint", "max_model_len", "max_images_per_request", "max_image_pixels", "max_request_bytes", "max_upload_bytes", "transfer_mode", "tensor_parallel_size", "group_ready", "max_video_frames", "max_video_seconds", "max_video_frame_pixels")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_READY_FIELD_NUMBER: _ClassVar[int]
    MAX_VIDEO_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_VIDEO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_VIDEO_FRAME_PIXELS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_fingerprint: str
    max_model_len: int
    max_images_per_request: int
    max_image_pixels: int
    max_request_bytes: int
    max_upload_bytes: int
    transfer_mode: TransferMode
    tensor_parallel_size: int
    group_ready: bool
    max_video_frames: int
    max_video_seconds: float
    max_video_frame_pixels: int
    def __init__(self, model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., max_model_len: _Optional[int] = ..., max_images_per_request: _Optional[int] = ..., max_image_pixels: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., max_upload_bytes: _Optional[int] = ..., transfer_mode: _Optional[_Union[TransferMode, str]] = ..., tensor_parallel_size: _Optional[int] = ..., group_ready: _Optional[bool] = ..., max_video_frames: _Optional[int] = ..., max_video_seconds: _Optional[float] = ..., max_video_frame_pixels: _Optional[int] = ...) -> None: ...
