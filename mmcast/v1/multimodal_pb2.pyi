from mmcast.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_VIDEO: _ClassVar[Modality]

class FieldKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FIELD_KIND_UNSPECIFIED: _ClassVar[FieldKind]
    FIELD_KIND_BATCHED: _ClassVar[FieldKind]
    FIELD_KIND_FLAT: _ClassVar[FieldKind]
    FIELD_KIND_SHARED: _ClassVar[FieldKind]

class PayloadState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_STATE_UNSPECIFIED: _ClassVar[PayloadState]
    PAYLOAD_STATE_PRESENT: _ClassVar[PayloadState]
    PAYLOAD_STATE_STRIPPED: _ClassVar[PayloadState]
    PAYLOAD_STATE_DEFERRED: _ClassVar[PayloadState]
    PAYLOAD_STATE_RANK_CACHED: _ClassVar[PayloadState]

class PayloadEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_ENCODING_UNSPECIFIED: _ClassVar[PayloadEncoding]
    PAYLOAD_ENCODING_PIXELS: _ClassVar[PayloadEncoding]
    PAYLOAD_ENCODING_ENCODED: _ClassVar[PayloadEncoding]
MODALITY_UNSPECIFIED: Modality
MODALITY_IMAGE: Modality
MODALITY_VIDEO: Modality
FIELD_KIND_UNSPECIFIED: FieldKind
FIELD_KIND_BATCHED: FieldKind
FIELD_KIND_FLAT: FieldKind
FIELD_KIND_SHARED: FieldKind
PAYLOAD_STATE_UNSPECIFIED: PayloadState
PAYLOAD_STATE_PRESENT: PayloadState
PAYLOAD_STATE_STRIPPED: PayloadState
PAYLOAD_STATE_DEFERRED: PayloadState
PAYLOAD_STATE_RANK_CACHED: PayloadState
PAYLOAD_ENCODING_UNSPECIFIED: PayloadEncoding
PAYLOAD_ENCODING_PIXELS: PayloadEncoding
PAYLOAD_ENCODING_ENCODED: PayloadEncoding

class PlaceholderRange(_message.Message):
    __slots__ = ("offset", "length", "is_embed")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    IS_EMBED_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    is_embed: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., is_embed: _Optional[_Iterable[bool]] = ...) -> None: ...

class MultiModalField(_message.Message):
    __slots__ = ("name", "kind", "keep_on_cpu", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEEP_ON_CPU_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: FieldKind
    keep_on_cpu: bool
    tensor: _tensor_pb2.TensorHeader
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[FieldKind, str]] = ..., keep_on_cpu: _Optional[bool] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ...) -> None: ...

class MultiModalItem(_message.Message):
    __slots__ = ("identifier", "modality", "position", "payload_state", "fields", "encoding")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_STATE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    modality: Modality
    position: PlaceholderRange
    payload_state: PayloadState
    fields: _containers.RepeatedCompositeFieldContainer[MultiModalField]
    encoding: PayloadEncoding
    def __init__(self, identifier: _Optional[str] = ..., modality: _Optional[_Union[Modality, str]] = ..., position: _Optional[_Union[PlaceholderRange, _Mapping]] = ..., payload_state: _Optional[_Union[PayloadState, str]] = ..., fields: _Optional[_Iterable[_Union[MultiModalField, _Mapping]]] = ..., encoding: _Optional[_Union[PayloadEncoding, str]] = ...) -> None: ...
