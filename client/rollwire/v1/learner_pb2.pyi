from rollwire.v1 import generator_pb2 as _generator_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Trajectory(_message.Message):
    __slots__ = ("group_id", "group_size", "prompt_token_ids", "token_ids", "loss_mask", "logprobs", "token_versions", "reward", "correct", "trajectory_id", "receipts")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    group_size: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    correct: bool
    trajectory_id: str
    receipts: _containers.RepeatedCompositeFieldContainer[ReceiptSpan]
    def __init__(self, group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., logprobs: _Optional[_Iterable[float]] = ..., token_versions: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., correct: _Optional[bool] = ..., trajectory_id: _Optional[str] = ..., receipts: _Optional[_Iterable[_Union[ReceiptSpan, _Mapping]]] = ...) -> None: ...

class ReceiptSpan(_message.Message):
    __slots__ = ("start", "receipt")
    START_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    start: int
    receipt: _generator_pb2.SampleReceipt
    def __init__(self, start: _Optional[int] = ..., receipt: _Optional[_Union[_generator_pb2.SampleReceipt, _Mapping]] = ...) -> None: ...

class SubmitTrajectoriesRequest(_message.Message):
    __slots__ = ("trajectory",)
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    trajectory: Trajectory
    def __init__(self, trajectory: _Optional[_Union[Trajectory, _Mapping]] = ...) -> None: ...

class SubmitTrajectoriesResponse(_message.Message):
    __slots__ = ("index", "trajectory_id", "group_id", "status", "group_complete", "newest_version", "oldest_version")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    GROUP_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    NEWEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    OLDEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    index: int
    trajectory_id: str
    group_id: str
    status: TrajectoryStatus
    group_complete: bool
    newest_version: int
    oldest_version: int
    def __init__(self, index: _Optional[int] = ..., trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., status: _Optional[_Union[TrajectoryStatus, _Mapping]] = ..., group_complete: _Optional[bool] = ..., newest_version: _Optional[int] = ..., oldest_version: _Optional[int] = ...) -> None: ...

class TrajectoryStatus(_message.Message):
    __slots__ = ("code", "reason", "message", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: int
    reason: str
    message: str
    retry_after_ms: int
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class GetIngestStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetIngestStatusResponse(_message.Message):
    __slots__ = ("newest_version", "oldest_version", "pending_groups", "max_pending_groups", "adapter_name", "model_fingerprint", "vocab_size")
    NEWEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    OLDEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    newest_version: int
    oldest_version: int
    pending_groups: int
    max_pending_groups: int
    adapter_name: str
    model_fingerprint: str
    vocab_size: int
    def __init__(self, newest_version: _Optional[int] = ..., oldest_version: _Optional[int] = ..., pending_groups: _Optional[int] = ..., max_pending_groups: _Optional[int] = ..., adapter_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ...) -> None: ...
