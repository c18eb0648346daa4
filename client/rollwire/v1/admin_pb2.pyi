from rollwire.v1 import generator_pb2 as _generator_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
