from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed", "ignore_eos", "return_kept_tokens", "sample_seeds")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RETURN_KEPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SEEDS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    ignore_eos: bool
    return_kept_tokens: bool
    sample_seeds: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., return_kept_tokens: _Optional[bool] = ..., sample_seeds: _Optional[_Iterable[int]] = ...) -> None: ...

class AdapterRef(_message.Message):
    __slots__ = ("name", "version", "follow")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    follow: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "n", "sampling", "adapter", "group_key", "session", "stream_interval", "resume", "return_routed_experts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    n: int
    sampling: SamplingParams
    adapter: AdapterRef
    group_key: str
    session: SessionTurn
    stream_interval: int
    resume: _containers.RepeatedCompositeFieldContainer[SampleResume]
    return_routed_experts: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., n: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ..., group_key: _Optional[str] = ..., session: _Optional[_Union[SessionTurn, _Mapping]] = ..., stream_interval: _Optional[int] = ..., resume: _Optional[_Iterable[_Union[SampleResume, _Mapping]]] = ..., return_routed_experts: _Optional[bool] = ...) -> None: ...

class SampleResume(_message.Message):
    __slots__ = ("sample_index", "token_ids")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionTurn(_message.Message):
    __slots__ = ("id", "end", "expect_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    EXPECT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    end: bool
    expect_tokens: int
    def __init__(self, id: _Optional[str] = ..., end: _Optional[bool] = ..., expect_tokens: _Optional[int] = ...) -> None: ...

class GenerationStarted(_message.Message):
    __slots__ = ("request_id", "adapter", "prompt_token_ids", "replica", "resumed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter: AdapterRef
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    replica: str
    resumed: int
    def __init__(self, request_id: _Optional[str] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., replica: _Optional[str] = ..., resumed: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("sample_index", "token_ids", "logprobs", "text", "adapter_version", "kept_tokens")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    adapter_version: int
    kept_tokens: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., adapter_version: _Optional[int] = ..., kept_tokens: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SampleFinished(_message.Message):
    __slots__ = ("sample_index", "finish_reason", "prompt_tokens", "completion_tokens", "routed_experts", "receipt")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    routed_experts: RoutedExperts
    receipt: SampleReceipt
    def __init__(self, sample_index: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., receipt: _Optional[_Union[SampleReceipt, _Mapping]] = ...) -> None: ...

class SampleReceipt(_message.Message):
    __slots__ = ("signer", "signature", "adapter", "context_sha256", "tokens_sha256", "logprobs_sha256", "versions_sha256", "tokens", "sample_id", "issued_unix_ms")
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SHA256_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_SHA256_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    ISSUED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    signer: str
    signature: bytes
    adapter: str
    context_sha256: bytes
    tokens_sha256: bytes
    logprobs_sha256: bytes
    versions_sha256: bytes
    tokens: int
    sample_id: str
    issued_unix_ms: int
    def __init__(self, signer: _Optional[str] = ..., signature: _Optional[bytes] = ..., adapter: _Optional[str] = ..., context_sha256: _Optional[bytes] = ..., tokens_sha256: _Optional[bytes] = ..., logprobs_sha256: _Optional[bytes] = ..., versions_sha256: _Optional[bytes] = ..., tokens: _Optional[int] = ..., sample_id: _Optional[str] = ..., issued_unix_ms: _Optional[int] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("positions", "layers", "top_k", "expert_ids")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    positions: int
    layers: int
    top_k: int
    expert_ids: bytes
    def __init__(self, positions: _Optional[int] = ..., layers: _Optional[int] = ..., top_k: _Optional[int] = ..., expert_ids: _Optional[bytes] = ...) -> None: ...

class GroupRestarted(_message.Message):
    __slots__ = ("attempt", "reason")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    reason: str
    def __init__(self, attempt: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("started", "tokens", "finished", "restarted")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    started: GenerationStarted
    tokens: _containers.RepeatedCompositeFieldContainer[TokenChunk]
    finished: _containers.RepeatedCompositeFieldContainer[SampleFinished]
    restarted: GroupRestarted
    def __init__(self, started: _Optional[_Union[GenerationStarted, _Mapping]] = ..., tokens: _Optional[_Iterable[_Union[TokenChunk, _Mapping]]] = ..., finished: _Optional[_Iterable[_Union[SampleFinished, _Mapping]]] = ..., restarted: _Optional[_Union[GroupRestarted, _Mapping]] = ...) -> None: ...

class LoraConfig(_message.Message):
    __slots__ = ("r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern")
    R_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    RANK_PATTERN_FIELD_NUMBER: _ClassVar[int]
    ALPHA_PATTERN_FIELD_NUMBER: _ClassVar[int]
    r: int
    lora_alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    use_rslora: bool
    rank_pattern: _containers.RepeatedCompositeFieldContainer[LoraPattern]
    alpha_pattern: _containers.RepeatedCompositeFieldContainer[LoraPattern]
    def __init__(self, r: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., use_rslora: _Optional[bool] = ..., rank_pattern: _Optional[_Iterable[_Union[LoraPattern, _Mapping]]] = ..., alpha_pattern: _Optional[_Iterable[_Union[LoraPattern, _Mapping]]] = ...) -> None: ...

class LoraPattern(_message.Message):
    __slots__ = ("pattern", "value")
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    pattern: str
    value: float
    def __init__(self, pattern: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class AdapterManifest(_message.Message):
    __slots__ = ("name", "version", "base_model_fingerprint", "lora_config", "byte_length", "sha256", "signature", "signer", "blake3", "probe")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    base_model_fingerprint: str
    lora_config: LoraConfig
    byte_length: int
    sha256: str
    signature: bytes
    signer: str
    blake3: str
    probe: AdapterProbe
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., base_model_fingerprint: _Optional[str] = ..., lora_config: _Optional[_Union[LoraConfig, _Mapping]] = ..., byte_length: _Optional[int] = ..., sha256: _Optional[str] = ..., signature: _Optional[bytes] = ..., signer: _Optional[str] = ..., blake3: _Optional[str] = ..., probe: _Optional[_Union[AdapterProbe, _Mapping]] = ...) -> None: ...

class AdapterProbe(_message.Message):
    __slots__ = ("sequences", "expected", "seed")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[ScoreSequence]
    expected: _containers.RepeatedCompositeFieldContainer[SequenceScore]
    seed: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[ScoreSequence, _Mapping]]] = ..., expected: _Optional[_Iterable[_Union[SequenceScore, _Mapping]]] = ..., seed: _Optional[int] = ...) -> None: ...

class AdapterProof(_message.Message):
    __slots__ = ("outcome", "max_abs_gap", "where", "tolerance", "proved_at", "reference")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_GAP_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    PROVED_AT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    max_abs_gap: float
    where: str
    tolerance: float
    proved_at: float
    reference: str
    def __init__(self, outcome: _Optional[str] = ..., max_abs_gap: _Optional[float] = ..., where: _Optional[str] = ..., tolerance: _Optional[float] = ..., proved_at: _Optional[float] = ..., reference: _Optional[str] = ...) -> None: ...

class PushAdapterRequest(_message.Message):
    __slots__ = ("manifest", "chunk", "relay", "stage_only", "stripe", "granted", "bulk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    STAGE_ONLY_FIELD_NUMBER: _ClassVar[int]
    STRIPE_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    manifest: AdapterManifest
    chunk: bytes
    relay: RelayPlan
    stage_only: bool
    stripe: Stripe
    granted: RelayNode
    bulk: bool
    def __init__(self, manifest: _Optional[_Union[AdapterManifest, _Mapping]] = ..., chunk: _Optional[bytes] = ..., relay: _Optional[_Union[RelayPlan, _Mapping]] = ..., stage_only: _Optional[bool] = ..., stripe: _Optional[_Union[Stripe, _Mapping]] = ..., granted: _Optional[_Union[RelayNode, _Mapping]] = ..., bulk: _Optional[bool] = ...) -> None: ...

class Stripe(_message.Message):
    __slots__ = ("index", "count", "chunk_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    chunk_bytes: int
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class RelayPlan(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[RelayNode]
    def __init__(self, nodes: _Optional[_Iterable[_Union[RelayNode, _Mapping]]] = ...) -> None: ...

class RelayNode(_message.Message):
    __slots__ = ("address", "name", "parent", "grant")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    address: str
    name: str
    parent: int
    grant: bytes
    def __init__(self, address: _Optional[str] = ..., name: _Optional[str] = ..., parent: _Optional[int] = ..., grant: _Optional[bytes] = ...) -> None: ...

class ReplicaPushResult(_message.Message):
    __slots__ = ("replica", "code", "message", "address", "staged", "reason", "stripe_pending")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STRIPE_PENDING_FIELD_NUMBER: _ClassVar[int]
    replica: str
    code: str
    message: str
    address: str
    staged: bool
    reason: str
    stripe_pending: bool
    def __init__(self, replica: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., address: _Optional[str] = ..., staged: _Optional[bool] = ..., reason: _Optional[str] = ..., stripe_pending: _Optional[bool] = ...) -> None: ...

class PushAdapterResponse(_message.Message):
    __slots__ = ("name", "version", "already_loaded", "loaded_versions", "replicas", "staged", "stripe_pending", "peers", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    STRIPE_PENDING_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    already_loaded: bool
    loaded_versions: _containers.RepeatedScalarFieldContainer[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaPushResult]
    staged: bool
    stripe_pending: bool
    peers: _containers.RepeatedCompositeFieldContainer[PeerPushResult]
    sha256: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., already_loaded: _Optional[bool] = ..., loaded_versions: _Optional[_Iterable[int]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaPushResult, _Mapping]]] = ..., staged: _Optional[bool] = ..., stripe_pending: _Optional[bool] = ..., peers: _Optional[_Iterable[_Union[PeerPushResult, _Mapping]]] = ..., sha256: _Optional[str] = ...) -> None: ...

class PeerPushResult(_message.Message):
    __slots__ = ("address", "code", "message", "reason")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    address: str
    code: str
    message: str
    reason: str
    def __init__(self, address: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CommitAdapterRequest(_message.Message):
    __slots__ = ("name", "version", "sha256", "blake3")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    sha256: str
    blake3: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., sha256: _Optional[str] = ..., blake3: _Optional[str] = ...) -> None: ...

class CommitAdapterResponse(_message.Message):
    __slots__ = ("name", "version", "already_loaded", "loaded_versions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    already_loaded: bool
    loaded_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., already_loaded: _Optional[bool] = ..., loaded_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadedAdapter(_message.Message):
    __slots__ = ("name", "versions", "digests", "signers", "proofs")
    class DigestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class SignersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class ProofsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: AdapterProof
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[AdapterProof, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SIGNERS_FIELD_NUMBER: _ClassVar[int]
    PROOFS_FIELD_NUMBER: _ClassVar[int]
    name: str
    versions: _containers.RepeatedScalarFieldContainer[int]
    digests: _containers.ScalarMap[int, str]
    signers: _containers.ScalarMap[int, str]
    proofs: _containers.MessageMap[int, AdapterProof]
    def __init__(self, name: _Optional[str] = ..., versions: _Optional[_Iterable[int]] = ..., digests: _Optional[_Mapping[int, str]] = ..., signers: _Optional[_Mapping[int, str]] = ..., proofs: _Optional[_Mapping[int, AdapterProof]] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("address", "replica", "healthy", "draining", "in_flight", "adapters", "detail")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    address: str
    replica: str
    healthy: bool
    draining: bool
    in_flight: int
    adapters: _containers.RepeatedCompositeFieldContainer[LoadedAdapter]
    detail: str
    def __init__(self, address: _Optional[str] = ..., replica: _Optional[str] = ..., healthy: _Optional[bool] = ..., draining: _Optional[bool] = ..., in_flight: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[LoadedAdapter, _Mapping]]] = ..., detail: _Optional[str] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("role", "replica", "model_fingerprint", "engine", "adapters", "in_flight", "queue_depth", "limits", "replicas", "server_version", "base_linear_layers", "instance")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_LINEAR_LAYERS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    role: str
    replica: str
    model_fingerprint: str
    engine: str
    adapters: _containers.RepeatedCompositeFieldContainer[LoadedAdapter]
    in_flight: int
    queue_depth: int
    limits: Limits
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    server_version: str
    base_linear_layers: _containers.RepeatedCompositeFieldContainer[LinearLayer]
    instance: str
    def __init__(self, role: _Optional[str] = ..., replica: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., engine: _Optional[str] = ..., adapters: _Optional[_Iterable[_Union[LoadedAdapter, _Mapping]]] = ..., in_flight: _Optional[int] = ..., queue_depth: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., server_version: _Optional[str] = ..., base_linear_layers: _Optional[_Iterable[_Union[LinearLayer, _Mapping]]] = ..., instance: _Optional[str] = ...) -> None: ...

class LinearLayer(_message.Message):
    __slots__ = ("module", "out_features", "in_features")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    OUT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    IN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    module: str
    out_features: int
    in_features: int
    def __init__(self, module: _Optional[str] = ..., out_features: _Optional[int] = ..., in_features: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_n", "max_new_tokens", "max_prompt_tokens", "max_adapter_bytes", "adapter_window", "max_context", "adapter_keep")
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_KEEP_FIELD_NUMBER: _ClassVar[int]
    max_n: int
    max_new_tokens: int
    max_prompt_tokens: int
    max_adapter_bytes: int
    adapter_window: int
    max_context: int
    adapter_keep: int
    def __init__(self, max_n: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_adapter_bytes: _Optional[int] = ..., adapter_window: _Optional[int] = ..., max_context: _Optional[int] = ..., adapter_keep: _Optional[int] = ...) -> None: ...

class ScoreSequence(_message.Message):
    __slots__ = ("prompt_token_ids", "continuation_token_ids")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    continuation_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., continuation_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "adapter", "sequences", "top_k")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter: AdapterRef
    sequences: _containers.RepeatedCompositeFieldContainer[ScoreSequence]
    top_k: int
    def __init__(self, request_id: _Optional[str] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ..., sequences: _Optional[_Iterable[_Union[ScoreSequence, _Mapping]]] = ..., top_k: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SequenceScore(_message.Message):
    __slots__ = ("logprobs", "top")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "adapter", "sha256", "signer", "model_fingerprint", "replica", "sequences")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    adapter: AdapterRef
    sha256: str
    signer: str
    model_fingerprint: str
    replica: str
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceScore]
    def __init__(self, request_id: _Optional[str] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ..., sha256: _Optional[str] = ..., signer: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., replica: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[SequenceScore, _Mapping]]] = ...) -> None: ...
