import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from mmcast.v1 import logprob_pb2 as _logprob_pb2
from mmcast.v1 import multimodal_pb2 as _multimodal_pb2
from mmcast.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]

class ProtocolErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_ERROR_CODE_UNSPECIFIED: _ClassVar[ProtocolErrorCode]
    PROTOCOL_ERROR_CODE_MISSING_PAYLOAD: _ClassVar[ProtocolErrorCode]
    PROTOCOL_ERROR_CODE_UNKNOWN_REQUEST: _ClassVar[ProtocolErrorCode]
    PROTOCOL_ERROR_CODE_BAD_TENSOR: _ClassVar[ProtocolErrorCode]
    PROTOCOL_ERROR_CODE_STATE_MISMATCH: _ClassVar[ProtocolErrorCode]
    PROTOCOL_ERROR_CODE_OUT_OF_RANGE: _ClassVar[ProtocolErrorCode]
    PROTOCOL_ERROR_CODE_INTERNAL: _ClassVar[ProtocolErrorCode]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion
PROTOCOL_ERROR_CODE_UNSPECIFIED: ProtocolErrorCode
PROTOCOL_ERROR_CODE_MISSING_PAYLOAD: ProtocolErrorCode
PROTOCOL_ERROR_CODE_UNKNOWN_REQUEST: ProtocolErrorCode
PROTOCOL_ERROR_CODE_BAD_TENSOR: ProtocolErrorCode
PROTOCOL_ERROR_CODE_STATE_MISMATCH: ProtocolErrorCode
PROTOCOL_ERROR_CODE_OUT_OF_RANGE: ProtocolErrorCode
PROTOCOL_ERROR_CODE_INTERNAL: ProtocolErrorCode

class StepRequest(_message.Message):
    __slots__ = ("handshake", "payload", "control", "keepalive", "late_token_masks")
    HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    LATE_TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    handshake: Handshake
    payload: PayloadFrame
    control: StepControl
    keepalive: Keepalive
    late_token_masks: LateTokenMasks
    def __init__(self, handshake: _Optional[_Union[Handshake, _Mapping]] = ..., payload: _Optional[_Union[PayloadFrame, _Mapping]] = ..., control: _Optional[_Union[StepControl, _Mapping]] = ..., keepalive: _Optional[_Union[Keepalive, _Mapping]] = ..., late_token_masks: _Optional[_Union[LateTokenMasks, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("handshake_ack", "step_result", "error", "keepalive")
    HANDSHAKE_ACK_FIELD_NUMBER: _ClassVar[int]
    STEP_RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    handshake_ack: HandshakeAck
    step_result: StepResult
    error: ProtocolError
    keepalive: Keepalive
    def __init__(self, handshake_ack: _Optional[_Union[HandshakeAck, _Mapping]] = ..., step_result: _Optional[_Union[StepResult, _Mapping]] = ..., error: _Optional[_Union[ProtocolError, _Mapping]] = ..., keepalive: _Optional[_Union[Keepalive, _Mapping]] = ...) -> None: ...

class Keepalive(_message.Message):
    __slots__ = ("sent_unix_nanos",)
    SENT_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    sent_unix_nanos: int
    def __init__(self, sent_unix_nanos: _Optional[int] = ...) -> None: ...

class Handshake(_message.Message):
    __slots__ = ("protocol_version", "model_fingerprint", "rank", "world_size", "scheduler_epoch", "scheduler_id", "block_size", "image_formats", "max_image_pixels", "video_limits")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FORMATS_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_LIMITS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    model_fingerprint: str
    rank: int
    world_size: int
    scheduler_epoch: int
    scheduler_id: str
    block_size: int
    image_formats: _containers.RepeatedScalarFieldContainer[str]
    max_image_pixels: int
    video_limits: VideoDecodeLimits
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., model_fingerprint: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., scheduler_epoch: _Optional[int] = ..., scheduler_id: _Optional[str] = ..., block_size: _Optional[int] = ..., image_formats: _Optional[_Iterable[str]] = ..., max_image_pixels: _Optional[int] = ..., video_limits: _Optional[_Union[VideoDecodeLimits, _Mapping]] = ...) -> None: ...

class VideoDecodeLimits(_message.Message):
    __slots__ = ("max_bytes", "max_frame_pixels", "max_duration_seconds", "max_total_frames", "max_sampled_frames", "max_streams")
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    max_bytes: int
    max_frame_pixels: int
    max_duration_seconds: float
    max_total_frames: int
    max_sampled_frames: int
    max_streams: int
    def __init__(self, max_bytes: _Optional[int] = ..., max_frame_pixels: _Optional[int] = ..., max_duration_seconds: _Optional[float] = ..., max_total_frames: _Optional[int] = ..., max_sampled_frames: _Optional[int] = ..., max_streams: _Optional[int] = ...) -> None: ...

class HandshakeAck(_message.Message):
    __slots__ = ("protocol_version", "model_fingerprint", "rank", "world_size", "kv_blocks", "payload_cache_bytes", "encoder_cache_tokens", "max_tensor_bytes", "max_model_len", "device", "encoder_output_row_bytes", "last_sampled_input", "late_token_masks")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ENCODER_OUTPUT_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_SAMPLED_INPUT_FIELD_NUMBER: _ClassVar[int]
    LATE_TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    model_fingerprint: str
    rank: int
    world_size: int
    kv_blocks: int
    payload_cache_bytes: int
    encoder_cache_tokens: int
    max_tensor_bytes: int
    max_model_len: int
    device: str
    encoder_output_row_bytes: int
    last_sampled_input: bool
    late_token_masks: bool
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., model_fingerprint: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., payload_cache_bytes: _Optional[int] = ..., encoder_cache_tokens: _Optional[int] = ..., max_tensor_bytes: _Optional[int] = ..., max_model_len: _Optional[int] = ..., device: _Optional[str] = ..., encoder_output_row_bytes: _Optional[int] = ..., last_sampled_input: _Optional[bool] = ..., late_token_masks: _Optional[bool] = ...) -> None: ...

class PayloadFrame(_message.Message):
    __slots__ = ("item_identifier", "field_name", "header", "chunk")
    ITEM_IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    FIELD_NAME_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    item_identifier: str
    field_name: str
    header: _tensor_pb2.TensorHeader
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, item_identifier: _Optional[str] = ..., field_name: _Optional[str] = ..., header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class WorkerSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "logprobs", "return_logprobs", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias_token_ids", "logit_bias_values", "min_tokens", "min_tokens_masked_ids", "bad_words")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_MASKED_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    logprobs: int
    return_logprobs: bool
    top_k: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    min_tokens: int
    min_tokens_masked_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., return_logprobs: _Optional[bool] = ..., top_k: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., min_tokens: _Optional[int] = ..., min_tokens_masked_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "mm_items", "sampling", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "num_output_tokens", "live")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    mm_items: _containers.RepeatedCompositeFieldContainer[_multimodal_pb2.MultiModalItem]
    sampling: WorkerSampling
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_output_tokens: int
    live: LiveContext
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., mm_items: _Optional[_Iterable[_Union[_multimodal_pb2.MultiModalItem, _Mapping]]] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., live: _Optional[_Union[LiveContext, _Mapping]] = ...) -> None: ...

class LiveContext(_message.Message):
    __slots__ = ("positions_from", "position_offset", "kv_moves")
    POSITIONS_FROM_FIELD_NUMBER: _ClassVar[int]
    POSITION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    KV_MOVES_FIELD_NUMBER: _ClassVar[int]
    positions_from: int
    position_offset: int
    kv_moves: _containers.RepeatedCompositeFieldContainer[KvMove]
    def __init__(self, positions_from: _Optional[int] = ..., position_offset: _Optional[int] = ..., kv_moves: _Optional[_Iterable[_Union[KvMove, _Mapping]]] = ...) -> None: ...

class KvMove(_message.Message):
    __slots__ = ("src", "dst", "count")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    count: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class RunningRequest(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "new_block_ids", "num_computed_tokens", "num_scheduled_tokens", "input_is_last_sampled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IS_LAST_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    input_is_last_sampled: bool
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., input_is_last_sampled: _Optional[bool] = ...) -> None: ...

class EncoderInput(_message.Message):
    __slots__ = ("item_identifier", "owner_rank", "replicated")
    ITEM_IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FIELD_NUMBER: _ClassVar[int]
    item_identifier: str
    owner_rank: int
    replicated: bool
    def __init__(self, item_identifier: _Optional[str] = ..., owner_rank: _Optional[int] = ..., replicated: _Optional[bool] = ...) -> None: ...

class StepControl(_message.Message):
    __slots__ = ("step_id", "new_requests", "running", "finished_request_ids", "encoder_inputs", "evict_payload_ids", "evict_encoder_ids", "reset_caches", "token_masks", "masks_follow", "prior_masks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_INPUTS_FIELD_NUMBER: _ClassVar[int]
    EVICT_PAYLOAD_IDS_FIELD_NUMBER: _ClassVar[int]
    EVICT_ENCODER_IDS_FIELD_NUMBER: _ClassVar[int]
    RESET_CACHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    PRIOR_MASKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    running: _containers.RepeatedCompositeFieldContainer[RunningRequest]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    encoder_inputs: _containers.RepeatedCompositeFieldContainer[EncoderInput]
    evict_payload_ids: _containers.RepeatedScalarFieldContainer[str]
    evict_encoder_ids: _containers.RepeatedScalarFieldContainer[str]
    reset_caches: bool
    token_masks: _containers.RepeatedCompositeFieldContainer[TokenMask]
    masks_follow: _containers.RepeatedScalarFieldContainer[str]
    prior_masks: LateTokenMasks
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., running: _Optional[_Iterable[_Union[RunningRequest, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., encoder_inputs: _Optional[_Iterable[_Union[EncoderInput, _Mapping]]] = ..., evict_payload_ids: _Optional[_Iterable[str]] = ..., evict_encoder_ids: _Optional[_Iterable[str]] = ..., reset_caches: _Optional[bool] = ..., token_masks: _Optional[_Iterable[_Union[TokenMask, _Mapping]]] = ..., masks_follow: _Optional[_Iterable[str]] = ..., prior_masks: _Optional[_Union[LateTokenMasks, _Mapping]] = ...) -> None: ...

class LateTokenMasks(_message.Message):
    __slots__ = ("step_id", "masks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    masks: _containers.RepeatedCompositeFieldContainer[TokenMask]
    def __init__(self, step_id: _Optional[int] = ..., masks: _Optional[_Iterable[_Union[TokenMask, _Mapping]]] = ...) -> None: ...

class TokenMask(_message.Message):
    __slots__ = ("request_id", "allowed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    allowed: bytes
    def __init__(self, request_id: _Optional[str] = ..., allowed: _Optional[bytes] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("request_id", "token_id", "logprob", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_logprob_pb2.TopLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_logprob_pb2.TopLogprob, _Mapping]]] = ...) -> None: ...

class WorkerStepStats(_message.Message):
    __slots__ = ("step_time", "encoder_time", "encoder_items", "payload_cache_bytes", "payload_cache_items", "encoder_cache_tokens", "received_payload_bytes", "encoder_runs", "collective_bytes", "collective_time", "preprocess_time", "forward_time", "sample_time", "assemble_time")
    STEP_TIME_FIELD_NUMBER: _ClassVar[int]
    ENCODER_TIME_FIELD_NUMBER: _ClassVar[int]
    ENCODER_ITEMS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CACHE_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODER_RUNS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_TIME_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_TIME_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TIME_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TIME_FIELD_NUMBER: _ClassVar[int]
    ASSEMBLE_TIME_FIELD_NUMBER: _ClassVar[int]
    step_time: _duration_pb2.Duration
    encoder_time: _duration_pb2.Duration
    encoder_items: int
    payload_cache_bytes: int
    payload_cache_items: int
    encoder_cache_tokens: int
    received_payload_bytes: int
    encoder_runs: int
    collective_bytes: int
    collective_time: _duration_pb2.Duration
    preprocess_time: _duration_pb2.Duration
    forward_time: _duration_pb2.Duration
    sample_time: _duration_pb2.Duration
    assemble_time: _duration_pb2.Duration
    def __init__(self, step_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., encoder_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., encoder_items: _Optional[int] = ..., payload_cache_bytes: _Optional[int] = ..., payload_cache_items: _Optional[int] = ..., encoder_cache_tokens: _Optional[int] = ..., received_payload_bytes: _Optional[int] = ..., encoder_runs: _Optional[int] = ..., collective_bytes: _Optional[int] = ..., collective_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., preprocess_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., forward_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., sample_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., assemble_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ItemFailure(_message.Message):
    __slots__ = ("item_identifier", "message")
    ITEM_IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    item_identifier: str
    message: str
    def __init__(self, item_identifier: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class RequestFailure(_message.Message):
    __slots__ = ("request_id", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    message: str
    def __init__(self, request_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "rank", "sampled", "stats", "failures", "item_failures")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    ITEM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rank: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    stats: WorkerStepStats
    failures: _containers.RepeatedCompositeFieldContainer[RequestFailure]
    item_failures: _containers.RepeatedCompositeFieldContainer[ItemFailure]
    def __init__(self, step_id: _Optional[int] = ..., rank: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., stats: _Optional[_Union[WorkerStepStats, _Mapping]] = ..., failures: _Optional[_Iterable[_Union[RequestFailure, _Mapping]]] = ..., item_failures: _Optional[_Iterable[_Union[ItemFailure, _Mapping]]] = ...) -> None: ...

class ProtocolError(_message.Message):
    __slots__ = ("step_id", "code", "message", "request_id", "item_identifier", "rank")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    code: ProtocolErrorCode
    message: str
    request_id: str
    item_identifier: str
    rank: int
    def __init__(self, step_id: _Optional[int] = ..., code: _Optional[_Union[ProtocolErrorCode, str]] = ..., message: _Optional[str] = ..., request_id: _Optional[str] = ..., item_identifier: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...
