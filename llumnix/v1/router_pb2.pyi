from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class HeldDemand(_message.Message):
    __slots__ = ("request_tokens",)
    REQUEST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_tokens: _Optional[_Iterable[int]] = ...) -> None: ...
