"""The rollwire Python SDK: sync `Client` and asyncio `AsyncClient` for generators and proxies.

Imports without torch. Results are plain dataclasses; failures are the typed exceptions of
rollwire.common.errors (re-exported here), raised from every gRPC status.
"""

from rollwire.client._channels import TlsConfig
from rollwire.client._push import LoraSpec, PeerPush, PeftAdapter, PushResult, ReplicaPush, read_peft_dir
from rollwire.client._requests import AdapterVersion, GenerateOptions, parse_adapter
from rollwire.client._results import (
    Finished,
    GenerateResult,
    GroupAccumulator,
    Restarted,
    RoutedExperts,
    Sample,
    Started,
    StreamEvent,
    Tokens,
)
from rollwire.client._retries import RetryPolicy, is_retryable
from rollwire.client._score import ScoreResult, ScoreSequence
from rollwire.client._session import AsyncSession, Session, TurnReply
from rollwire.client.aio import AsyncClient
from rollwire.client.sync import Client
from rollwire.common.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RequestError,
    ResourceExhausted,
    RollwireError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from rollwire.common.lora import LoraShape

__all__ = [
    "AdapterVersion",
    "AlreadyExists",
    "AsyncClient",
    "AsyncSession",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Finished",
    "GenerateOptions",
    "GenerateResult",
    "GroupAccumulator",
    "Internal",
    "InvalidArgument",
    "LoraShape",
    "LoraSpec",
    "NotFound",
    "PeerPush",
    "PeftAdapter",
    "PermissionDenied",
    "PushResult",
    "ReplicaPush",
    "RequestError",
    "ResourceExhausted",
    "Restarted",
    "RetryPolicy",
    "RollwireError",
    "RoutedExperts",
    "Sample",
    "ScoreResult",
    "ScoreSequence",
    "Session",
    "Started",
    "StreamEvent",
    "TlsConfig",
    "Tokens",
    "TurnReply",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "is_retryable",
    "parse_adapter",
    "read_peft_dir",
]
