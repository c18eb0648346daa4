"""Every reason a rollwire service or the SDK puts in an error: one vocabulary, in one place.

A failed call carries a gRPC status code (the kind of failure) and a `google.rpc.ErrorInfo`
(domain "rollwire.dev") whose `reason` names the failure for programs; the status message is
a sentence for people and may change, a reason never changes meaning once released. A status
with no rollwire reason carries its code's name (errors.to_status). Push outcomes per replica
(`ReplicaPushResult.reason`) use the same vocabulary.

Each member's docstring reads `CODES; RETRY: MEANING`: the status code(s) it is sent with,
whether the caller may send the same request again ("retry": it may succeed later or
elsewhere, unchanged; "do not retry": the request or the setup must change first; or when)
and what happened. docs/protocol.md lists them all, generated from these docstrings and
checked by tests/test_protocol_doc.py, which also fails when a source in client/, server/ or
learner/ spells a reason as a string or raises it with a code its docstring does not list.
Which layer retries what on its own is in retries.py.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """The stable `ErrorInfo.reason` values. A StrEnum whose names are its values, so a
    member compares, hashes and serialises as the plain string the wire carries."""

    # -- Generate: the request ------------------------------------------------------------
    BAD_N = "BAD_N"
    """INVALID_ARGUMENT; do not retry: `n` is outside 1..`limits.max_n`."""
    BAD_MAX_NEW_TOKENS = "BAD_MAX_NEW_TOKENS"
    """INVALID_ARGUMENT; do not retry: `max_new_tokens` is outside 1..the limit."""
    CONTEXT_TOO_LONG = "CONTEXT_TOO_LONG"
    """INVALID_ARGUMENT; do not retry: Prompt plus `max_new_tokens` exceed the context."""
    BAD_TEMPERATURE = "BAD_TEMPERATURE"
    """INVALID_ARGUMENT; do not retry: `temperature` is not 0 and not in [0.001, 100]."""
    BAD_TOP_P = "BAD_TOP_P"
    """INVALID_ARGUMENT; do not retry: `top_p` is not a finite number in (0, 1]."""
    BAD_TOP_K = "BAD_TOP_K"
    """INVALID_ARGUMENT; do not retry: `top_k` is negative or above the vocabulary size."""
    BAD_STOP = "BAD_STOP"
    """INVALID_ARGUMENT; do not retry: Too many stop strings, or one empty or too long."""
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"
    """INVALID_ARGUMENT; do not retry: The prompt is over `limits.max_prompt_tokens`."""
    BAD_TOKEN_ID = "BAD_TOKEN_ID"
    """INVALID_ARGUMENT; do not retry: A prompt token id is outside the vocabulary."""
    EMPTY_PROMPT = "EMPTY_PROMPT"
    """INVALID_ARGUMENT; do not retry: Neither `text` nor `token_ids` holds a token."""
    BAD_GROUP_KEY = "BAD_GROUP_KEY"
    """INVALID_ARGUMENT; do not retry: `group_key` is over 1024 characters."""
    BAD_ADAPTER_NAME = "BAD_ADAPTER_NAME"
    """INVALID_ARGUMENT; do not retry: An adapter name breaks the naming rule."""

    # -- Generate: the replica ------------------------------------------------------------
    QUEUE_FULL = "QUEUE_FULL"
    """RESOURCE_EXHAUSTED; retry: The replica's queue is full; after the hint, or elsewhere."""
    ADAPTER_NOT_FOUND = "ADAPTER_NOT_FOUND"
    """NOT_FOUND; do not retry: No adapter of that name is loaded; push it first."""
    ADAPTER_VERSION_NOT_FOUND = "ADAPTER_VERSION_NOT_FOUND"
    """NOT_FOUND; do not retry: That version was not pushed to this replica (yet)."""
    ADAPTER_VERSION_EVICTED = "ADAPTER_VERSION_EVICTED"
    """FAILED_PRECONDITION; do not retry: That version left the replica's window of newest versions."""
    NON_FINITE_LOGITS = "NON_FINITE_LOGITS"
    """FAILED_PRECONDITION; do not retry: The model gave NaN/inf for this request (a diverged adapter)."""
    ROW_FAILED = "ROW_FAILED"
    """INTERNAL; do not retry: Sampling this one request failed; the others were not affected."""
    ENGINE_FAILED = "ENGINE_FAILED"
    """INTERNAL; retry: A forward pass failed on the replica; no request is to blame."""
    STREAM_PROTOCOL = "STREAM_PROTOCOL"
    """INTERNAL; do not retry: (SDK) The server broke the Generate stream contract."""

    # -- PushAdapter: the manifest and the stream -----------------------------------------
    BAD_ADAPTER_VERSION = "BAD_ADAPTER_VERSION"
    """INVALID_ARGUMENT; do not retry: The version is not in 1..2^53."""
    VERSION_TOO_FAR = "VERSION_TOO_FAR"
    """INVALID_ARGUMENT; do not retry: The version is too far above the newest one held."""
    VERSION_NOT_MONOTONIC = "VERSION_NOT_MONOTONIC"
    """FAILED_PRECONDITION; do not retry: The version is not above the newest one held; push a higher one."""
    VERSION_CONFLICT = "VERSION_CONFLICT"
    """FAILED_PRECONDITION; do not retry: That version is held with another digest; versions are immutable."""
    BASE_MODEL_MISMATCH = "BASE_MODEL_MISMATCH"
    """FAILED_PRECONDITION; do not retry: The adapter was trained on another base model than the one served."""
    BAD_LORA_CONFIG = "BAD_LORA_CONFIG"
    """INVALID_ARGUMENT; do not retry: `lora_config` is out of bounds (r, alpha, modules)."""
    BAD_DIGEST = "BAD_DIGEST"
    """INVALID_ARGUMENT; do not retry: `sha256` is not 64 lowercase hex digits."""
    BAD_LENGTH = "BAD_LENGTH"
    """INVALID_ARGUMENT; do not retry: `byte_length` is not positive."""
    ADAPTER_TOO_LARGE = "ADAPTER_TOO_LARGE"
    """RESOURCE_EXHAUSTED; do not retry: The adapter is over the receiver's size limit."""
    BAD_RELAY_PLAN = "BAD_RELAY_PLAN"
    """INVALID_ARGUMENT; do not retry: The relay plan is malformed or too large."""
    RELAY_DISABLED = "RELAY_DISABLED"
    """FAILED_PRECONDITION; do not retry: This replica does not relay; push without a plan."""
    NO_MANIFEST = "NO_MANIFEST"
    """INVALID_ARGUMENT; do not retry: The push did not open with a manifest."""
    SECOND_MANIFEST = "SECOND_MANIFEST"
    """INVALID_ARGUMENT; do not retry: A manifest came after the first message."""
    MISPLACED_FIELD = "MISPLACED_FIELD"
    """INVALID_ARGUMENT; do not retry: `relay`/`stage_only` came after the first message."""
    CHUNK_TOO_LARGE = "CHUNK_TOO_LARGE"
    """INVALID_ARGUMENT; do not retry: A chunk is over 1 MiB."""
    LENGTH_MISMATCH = "LENGTH_MISMATCH"
    """INVALID_ARGUMENT; do not retry: The payload's length is not the declared one."""
    DIGEST_MISMATCH = "DIGEST_MISMATCH"
    """INVALID_ARGUMENT; do not retry: The payload's SHA-256 is not the declared one."""
    PUSH_IDLE = "PUSH_IDLE"
    """DEADLINE_EXCEEDED; retry: The upload paused past the idle timeout; push again."""
    TOO_MANY_PUSHES = "TOO_MANY_PUSHES"
    """RESOURCE_EXHAUSTED; retry: The replica takes no more pushes now; after the hint."""
    STORE_FAILED = "STORE_FAILED"
    """UNAVAILABLE; retry: The receiver could not store the upload; nothing applied."""
    DISK_FULL = "DISK_FULL"
    """RESOURCE_EXHAUSTED; retry when space is freed: The disk under the proxy's spool is full; nothing applied."""

    # -- PushAdapter: the payload ---------------------------------------------------------
    BAD_PAYLOAD = "BAD_PAYLOAD"
    """INVALID_ARGUMENT; do not retry: The payload is not a valid safetensors file."""
    TENSOR_MISMATCH = "TENSOR_MISMATCH"
    """INVALID_ARGUMENT; do not retry: The tensors do not fit the base model and `r`."""
    NON_FINITE_WEIGHTS = "NON_FINITE_WEIGHTS"
    """INVALID_ARGUMENT; do not retry: A tensor holds NaN or inf; push finite weights."""
    NOT_STAGED = "NOT_STAGED"
    """FAILED_PRECONDITION; do not retry: CommitAdapter names no staged version; push it again."""

    # -- PushAdapter: relayed pushes (ReplicaPushResult.reason) ---------------------------
    RELAY_NOT_REACHED = "RELAY_NOT_REACHED"
    """UNAVAILABLE; retry: The relay never reached this replica."""
    RELAY_STALLED = "RELAY_STALLED"
    """DEADLINE_EXCEEDED; retry: The replica took no chunk in time; its sender cut it off."""
    RELAY_ABORTED = "RELAY_ABORTED"
    """CANCELLED; retry: The upload above this replica failed; nothing was staged."""

    # -- The SGLang engine ----------------------------------------------------------------
    SEED_UNSUPPORTED = "SEED_UNSUPPORTED"
    """FAILED_PRECONDITION; do not retry: SGLang runs non-deterministic; drop the seed."""
    LORA_RANK_TOO_LARGE = "LORA_RANK_TOO_LARGE"
    """FAILED_PRECONDITION; do not retry: `r` is above `sglang.max_lora_rank`."""
    ADAPTER_SLOTS_FULL = "ADAPTER_SLOTS_FULL"
    """RESOURCE_EXHAUSTED; retry: SGLang's adapter slots all serve requests."""
    SGLANG_UNREACHABLE = "SGLANG_UNREACHABLE"
    """UNAVAILABLE; retry: SGLang is down or restarting."""
    SGLANG_DOWN = "SGLANG_DOWN"
    """UNAVAILABLE; retry: The replica's SGLang cannot serve right now."""
    SGLANG_CONNECTION_LOST = "SGLANG_CONNECTION_LOST"
    """UNAVAILABLE; retry: SGLang dropped the connection mid-call."""
    SGLANG_STREAM_CUT = "SGLANG_STREAM_CUT"
    """UNAVAILABLE; retry: SGLang ended a stream before every sample finished."""
    SGLANG_TIMEOUT = "SGLANG_TIMEOUT"
    """DEADLINE_EXCEEDED; retry: SGLang sent nothing within the request timeout."""
    SGLANG_START_TIMEOUT = "SGLANG_START_TIMEOUT"
    """DEADLINE_EXCEEDED; do not retry: SGLang did not become healthy at start."""
    SGLANG_START_FAILED = "SGLANG_START_FAILED"
    """FAILED_PRECONDITION; do not retry: SGLang exited while starting."""
    SGLANG_BAD_REQUEST = "SGLANG_BAD_REQUEST"
    """INVALID_ARGUMENT; do not retry: SGLang refused the request (HTTP 400/422)."""
    SGLANG_UNAUTHENTICATED = "SGLANG_UNAUTHENTICATED"
    """UNAUTHENTICATED; do not retry: SGLang refused the replica's API key."""
    SGLANG_FORBIDDEN = "SGLANG_FORBIDDEN"
    """PERMISSION_DENIED; do not retry: SGLang forbade the call (HTTP 403)."""
    SGLANG_NO_ROUTE = "SGLANG_NO_ROUTE"
    """FAILED_PRECONDITION; do not retry: SGLang lacks an endpoint; check its version."""
    SGLANG_TOO_LARGE = "SGLANG_TOO_LARGE"
    """INVALID_ARGUMENT; do not retry: SGLang refused the body as too large (HTTP 413)."""
    SGLANG_OVERLOADED = "SGLANG_OVERLOADED"
    """RESOURCE_EXHAUSTED; retry: SGLang is overloaded (HTTP 429)."""
    SGLANG_INTERNAL = "SGLANG_INTERNAL"
    """INTERNAL; do not retry: SGLang failed the request (HTTP 500)."""
    SGLANG_UNAVAILABLE = "SGLANG_UNAVAILABLE"
    """UNAVAILABLE; retry: SGLang is unavailable (HTTP 503)."""
    SGLANG_ERROR = "SGLANG_ERROR"
    """UNAVAILABLE or INVALID_ARGUMENT; retry when UNAVAILABLE: Any other HTTP error from SGLang (5xx: UNAVAILABLE)."""

    # -- Authentication ---------------------------------------------------------------------
    NO_TOKEN = "NO_TOKEN"
    """UNAUTHENTICATED; do not retry: The call carries no bearer token."""
    BAD_TOKEN = "BAD_TOKEN"
    """UNAUTHENTICATED; do not retry: The bearer token is not valid here."""
    NO_ROLE = "NO_ROLE"
    """PERMISSION_DENIED; do not retry: The method has no role assigned on this server."""
    WRONG_ROLE = "WRONG_ROLE"
    """PERMISSION_DENIED; do not retry: The method needs the admin role."""

    # -- The proxy --------------------------------------------------------------------------
    CLIENT_LIMIT = "CLIENT_LIMIT"
    """RESOURCE_EXHAUSTED; retry: This client is over its fair share; after the hint."""
    SLOW_READER = "SLOW_READER"
    """RESOURCE_EXHAUSTED; retry: The client left its stream unread; read as it comes."""
    PROXY_QUEUE_FULL = "PROXY_QUEUE_FULL"
    """RESOURCE_EXHAUSTED; retry: Every replica is full and so is the proxy's queue."""
    QUEUE_DEADLINE = "QUEUE_DEADLINE"
    """DEADLINE_EXCEEDED; retry: The deadline passed while the request was queued."""
    NO_REPLICA = "NO_REPLICA"
    """UNAVAILABLE; retry: No replica could serve the request or take the push."""
    ATTEMPTS_EXHAUSTED = "ATTEMPTS_EXHAUSTED"
    """UNAVAILABLE; retry: The group failed on `routing.max_attempts` replicas."""
    DEADLINE = "DEADLINE"
    """DEADLINE_EXCEEDED; do not retry: The group did not finish in time; give a longer deadline."""
    PROXY_PUBLISHES = "PROXY_PUBLISHES"
    """FAILED_PRECONDITION; do not retry: A proxy plans, stages and commits pushes itself."""
    SPOOL_FULL = "SPOOL_FULL"
    """RESOURCE_EXHAUSTED; retry when hinted: The spool is full (with uploads in flight when hinted)."""
    SPOOL_CHANGED = "SPOOL_CHANGED"
    """UNAVAILABLE; retry: The version left the spool while it was being pushed."""
    MISFILED = "MISFILED"
    """INVALID_ARGUMENT; do not retry: (Spool reload, never sent) A manifest is filed under another name."""
    DUPLICATE = "DUPLICATE"
    """INVALID_ARGUMENT; do not retry: (Spool reload, never sent) A version is spooled twice."""
    BAD_ADDRESS = "BAD_ADDRESS"
    """INVALID_ARGUMENT; do not retry: A registered address is not HOST:PORT."""
    UNKNOWN_REPLICA = "UNKNOWN_REPLICA"
    """NOT_FOUND; do not retry: No replica of that address is registered."""


__all__ = ["Reason"]
