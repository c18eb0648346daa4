from rollwire.v1 import generator_pb2 as _generator_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProveAdaptersRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ProveAdaptersResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[_generator_pb2.ReplicaStatus]
    def __init__(self, replicas: _Optional[_Iterable[_Union[_generator_pb2.ReplicaStatus, _Mapping]]] = ...) -> None: ...

class RegisterGeneratorRequest(_message.Message):
    __slots__ = ("address", "ttl_seconds")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    address: str
    ttl_seconds: int
    def __init__(self, address: _Optional[str] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class RegisterGeneratorResponse(_message.Message):
    __slots__ = ("replica", "created")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    replica: _generator_pb2.ReplicaStatus
    created: bool
    def __init__(self, replica: _Optional[_Union[_generator_pb2.ReplicaStatus, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class DeregisterGeneratorRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class DeregisterGeneratorResponse(_message.Message):
    __slots__ = ("restarted",)
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    restarted: int
    def __init__(self, restarted: _Optional[int] = ...) -> None: ...

class ListGeneratorsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListGeneratorsResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[_generator_pb2.ReplicaStatus]
    def __init__(self, replicas: _Optional[_Iterable[_Union[_generator_pb2.ReplicaStatus, _Mapping]]] = ...) -> None: ...

class DrainGeneratorRequest(_message.Message):
    __slots__ = ("address", "deregister")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEREGISTER_FIELD_NUMBER: _ClassVar[int]
    address: str
    deregister: bool
    def __init__(self, address: _Optional[str] = ..., deregister: _Optional[bool] = ...) -> None: ...

class DrainGeneratorResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: _generator_pb2.ReplicaStatus
    def __init__(self, replica: _Optional[_Union[_generator_pb2.ReplicaStatus, _Mapping]] = ...) -> None: ...

class ShareLineagesRequest(_message.Message):
    __slots__ = ("generations", "marks")
    class GenerationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    MARKS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.ScalarMap[str, int]
    marks: _containers.RepeatedCompositeFieldContainer[LineageMarks]
    def __init__(self, generations: _Optional[_Mapping[str, int]] = ..., marks: _Optional[_Iterable[_Union[LineageMarks, _Mapping]]] = ...) -> None: ...

class LineageMarks(_message.Message):
    __slots__ = ("name", "versions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    versions: _containers.RepeatedCompositeFieldContainer[VersionMark]
    def __init__(self, name: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[VersionMark, _Mapping]]] = ...) -> None: ...

class VersionMark(_message.Message):
    __slots__ = ("version", "unloaded", "at_ns", "by")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    AT_NS_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    version: int
    unloaded: bool
    at_ns: int
    by: str
    def __init__(self, version: _Optional[int] = ..., unloaded: _Optional[bool] = ..., at_ns: _Optional[int] = ..., by: _Optional[str] = ...) -> None: ...

class ShareLineagesResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: int
    def __init__(self, changed: _Optional[int] = ...) -> None: ...
