"""Typed configuration of the routing proxy (`rollwire proxy --config FILE --set k=v`).

Every section of the proxy's config is defined here but the dial settings' (upstream.py, which
imports nothing of the proxy's) and the tenants' (tenants.py, likewise); addresses are checked by the one rule of
rollwire.common.addresses, and policy names by the registry of rollwire.proxy.policies, which
does not import the config: so any proxy module may import this one and none is imported back.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from rollwire.common.addresses import check_address, check_target, parse_dns_target
from rollwire.common.writer import MAX_STRIPES
from rollwire.proxy.policies import POLICIES
from rollwire.proxy.tenants import TenantSection, check_tenants
from rollwire.proxy.upstream import UpstreamSection
from rollwire.runtime.config import Section
from rollwire.runtime.dialing import DialSection
from rollwire.serving.config import ForwardSection, PushLimits, ServerConfig, port_field, push_idle_field

MiB = 1 << 20


class RoutingSection(Section):
    """How requests are placed on replicas, retried and queued."""

    max_in_flight_per_replica: int = Field(default=32, ge=1)
    """Groups the proxy runs on one replica at once; more wait in the proxy's queue."""
    max_queue: int = Field(default=1024, ge=0)
    """Requests that may wait for a replica slot; beyond it RESOURCE_EXHAUSTED with a retry hint."""
    max_attempts: int = Field(default=3, ge=1)
    """Attempts per group, the first included; then UNAVAILABLE naming what failed."""
    resume: bool = True
    """When a replica fails after its group's client saw tokens, continue each unfinished sample on another replica
    from its tokens so far (GenerateRequest.resume; exact on the transformers engine) instead of restarting the group
    (`restarted`). false: always restart (routing/failover.py, routing/resume.py)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of a request whose client set none (or a longer one), so nothing hangs."""
    no_replica_wait_s: float = Field(default=10.0, ge=0)
    """How long a request waits for some replica able to serve it before UNAVAILABLE."""
    retry_after_s: float = Field(default=1.0, ge=0)
    """Retry hint sent with RESOURCE_EXHAUSTED and UNAVAILABLE."""
    affinity_prefix: int = Field(default=64, ge=1)
    """Leading prompt tokens (characters of a text prompt) hashed when no group_key is given."""
    affinity_load_factor: float = Field(default=1.25, ge=1.0)
    """Affinity spills to the least-loaded replica when its choice runs over this x the average..."""
    affinity_min_gap: int = Field(default=4, ge=0)
    """...and at least this many groups more than the least-loaded replica."""
    prefix_block: int = Field(default=16, ge=1, le=4096)
    """The prefix policy's block: prompts are indexed by their prefixes of whole blocks of this many tokens (4x as many
    bytes of a text prompt)."""
    prefix_index_entries: int = Field(default=1 << 16, ge=1, le=1 << 24)
    """Prefix hashes the prefix policy remembers (about 40 bytes each), least recently used forgotten first."""
    coalesce_window_ms: float = Field(default=3.0, ge=0, le=1000)
    """Single-sample requests (n = 1) for the same prompt, adapter and sampling settings that arrive within this many
    milliseconds of the first are served as one group: one prefill, one placement (TRL's worker sends a GRPO group as
    n such requests). A seeded request still draws exactly its own tokens. 0 = off (routing/coalesce.py)."""
    coalesce_max_n: int = Field(default=64, ge=1)
    """Most requests merged into one group (also capped by the replicas' max_n); a full group starts at once."""


class ScoreSection(Section):
    """Score requests (teacher-forced logprobs) at the proxy: refused beyond these before any routing; each replica
    checks its own limits too (limits.max_score_*)."""

    max_sequences: int = Field(default=256, ge=1)
    """Most sequences in one Score request."""
    max_tokens: int = Field(default=131072, ge=1)
    """Most tokens (prompts and continuations together) in one Score request."""
    max_top_k: int = Field(default=20, ge=0)
    """Largest top_k of a Score request."""


class ProofSection(Section):
    """Re-checks of adapter versions against their probes on every replica (publish/proof.py, docs/protocol.md
    "Proof")."""

    recheck_interval_s: float = Field(default=300.0, ge=0)
    """Seconds between re-checks of every version each routable replica serves that has a probe (the publisher's,
    or the one this proxy made from the first replica that committed it); 0 = only on demand (ProveAdapters,
    `rollwire status --prove`, POST /weight_info) and after each commit."""
    tolerance: float = Field(default=0.0, ge=0)
    """Largest |logprob - reference| a replica may show and pass; 0 takes its engine's default (transformers 1e-4,
    vllm and sglang 1e-3: rollwire.common.probe)."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of one replica's Score of a probe."""
    max_concurrent: int = Field(default=4, ge=1)
    """Probe Scores in flight at once over the whole fleet (a re-check is background work)."""


class HealthSection(Section):
    """Active health checks, ejection (circuit breaking) and recovery."""

    interval_s: float = Field(default=1.0, gt=0)
    """Seconds between gRPC health checks of each replica."""
    timeout_s: float = Field(default=2.0, gt=0)
    """Deadline of one health check or GetStatus call."""
    unhealthy_after: int = Field(default=2, ge=1)
    """Consecutive failed health checks that take a replica out of rotation."""
    status_every_s: float = Field(default=5.0, gt=0)
    """Seconds between GetStatus refreshes of what each replica holds (finds lost versions)."""
    eject_after_failures: int = Field(default=3, ge=1)
    """Consecutive failed attempts on one replica that open its circuit (eject it)."""
    eject_s: float = Field(default=2.0, gt=0)
    """First ejection; doubles on each consecutive ejection up to eject_max_s."""
    eject_max_s: float = Field(default=30.0, gt=0)
    """Longest ejection."""
    push_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of one adapter push to one replica (fan-out or catch-up)."""
    catch_up_attempts: int = Field(default=5, ge=1, le=1000)
    """Catch-up pushes of one spooled version to one replica that may fail for now (UNAVAILABLE, UNKNOWN,
    TOO_MANY_PUSHES, ...), one per health round, before it is decided: the replica is routed what it holds, and a
    failure that is not 'busy' counts as its refusal towards quarantine. Retried again once it reconnects."""


class SpoolSection(PushLimits):
    """The on-disk adapter spool: what new and returning replicas are caught up from."""

    dir: str = Field(default="")
    """Folder of spooled adapters, reloaded at start; empty = a private folder removed at exit."""
    max_bytes: int = Field(default=4096 * MiB, ge=1)
    """Bytes the spool may hold; older versions are evicted first."""
    keep_versions: int = Field(default=8, ge=1)
    """Newest versions of each adapter kept for catch-up (set it to the replicas' adapter_keep, the versions a caller
    may name)."""
    upload_idle_timeout_s: float = push_idle_field()


class PushSection(ForwardSection):
    """How the proxy broadcasts a pushed adapter: a relay tree of replicas, stage then commit.

    Each replica of the tree forwards every chunk to its children while it receives it, so
    the proxy's link carries `fanout` copies, not one per replica. With fan-out k over N
    replicas the tree is ~log_k(N) deep, and a push takes about
    k x (size + (depth - 1) x chunk) / link bandwidth: a chain (k = 1) is best while N is
    below the payload's chunk count, a wider tree beyond it. "auto" picks k per push from
    that model; 0 is a star (the proxy sends every replica its copy itself).

    By default a push is striped instead (`stripes`): its chunks are dealt over two such trees,
    each replica an inner node in at most one, so every link carries about one copy and the
    push takes about size / bandwidth + log2(N) x 2 chunk-times, whatever N. A `fanout` you set
    gives that single tree (stripes "auto" is then 1); heals always use a single tree."""

    fanout: int | Literal["auto"] = Field(default="auto")
    """Children per node of the relay tree: 1 = a chain, 0 = a star, "auto" = the k that minimises k x (chunks + depth
    - 1) for this push."""
    max_fanout: int = Field(default=16, ge=1, le=1024)
    """Largest fan-out "auto" may pick."""
    stripes: int | Literal["auto"] = Field(default="auto")
    """Trees a push is dealt over (plan.striped_layout): 1 = one tree of `fanout`; S = 2..8: S trees, each with one
    replica under the proxy and fan-out S below it, chunk j down tree j mod S, so every uplink carries about one copy
    whatever the number of replicas (2 = NCCL's double binary tree); "auto" = 2 while `fanout` is "auto", else 1 (a
    fan-out you set is the tree you get). Heals are never striped."""
    commit_timeout_s: float = Field(default=10.0, gt=0)
    """Deadline of one CommitAdapter call to one replica."""

    @field_validator("stripes")
    @classmethod
    def _stripes(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= MAX_STRIPES:
            raise ValueError(f'stripes is 1 (one tree) to {MAX_STRIPES}, or "auto"')
        return value

    def stripe_count(self) -> int:
        """The stripes a push is dealt over, "auto" resolved (before the replicas and chunks cap it)."""
        if self.stripes == "auto":
            return 2 if self.fanout == "auto" else 1
        return int(self.stripes)

    @field_validator("fanout")
    @classmethod
    def _fanout(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 0 <= value <= 1024:
            raise ValueError('fanout is 0 (star), 1 to 1024, or "auto"')
        return value


class FairnessSection(Section):
    """Per-client limits, so one client's load or a client that stops reading harms only itself.

    A client is the bearer token's identity where auth is on (a hash of the token, never the
    token), the peer's host otherwise (every client behind one NAT or on one host is one client)."""

    max_in_flight_per_client: int = Field(default=256, ge=1)
    """Generate requests one client may have open at the proxy (queued or running); beyond it RESOURCE_EXHAUSTED,
    reason CLIENT_LIMIT, with a retry hint, before any work."""
    max_queued_tokens_per_client: int = Field(default=1 << 20, ge=1)
    """Work one client may have waiting in the proxy's queue, as the sum of n x max_new_tokens of its queued requests;
    a request that would go over it is refused like max_in_flight_per_client (a client's first queued request is
    always accepted, however large)."""
    slow_reader_timeout_s: float = Field(default=30.0, gt=0)
    """A response message the client has not taken for this long (its flow-control window stays full) ends the request
    with RESOURCE_EXHAUSTED, reason SLOW_READER, and frees its replica slot."""


class RegistrationSection(Section):
    """What replicas that register themselves (AdminService) may hold."""

    max_ttl_s: int = Field(default=300, ge=1)
    """Longest ttl_seconds a registration may ask; a `register` token must give 1..this (0, for good, is admin's)."""
    max_members: int = Field(default=1024, ge=1)
    """Replicas this proxy holds at most, however they came; a registration past it is refused (TOO_MANY_MEMBERS)."""
    canary: bool = Field(default=True)
    """A replica a `register` token added serves only after its canary (greedy tokens and logprobs of a fixed prompt
    on the base model) matches a trusted routable replica's; false = its proof of address is enough."""
    canary_tolerance: float = Field(default=0.05, gt=0, le=10)
    """Largest difference between a canary's logprobs and the trusted replica's, per token (the tokens must match)."""
    canary_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of one canary call (to the new member, and to the trusted replica)."""


class FloorSection(Section):
    """The operator's floor under the fleet's limits: a member reporting less is refused (not routed, named in its
    status), so no member can shrink what clients are promised. max_context applies where a member reports one."""

    max_n: int = Field(default=1, ge=1)
    """Least `max_n` a member may report."""
    max_new_tokens: int = Field(default=8, ge=1)
    """Least `max_new_tokens` a member may report."""
    max_prompt_tokens: int = Field(default=8, ge=1)
    """Least `max_prompt_tokens` a member may report."""
    max_context: int = Field(default=32, ge=0)
    """Least `max_context` (prompt + generated tokens) a member may report; 0 = no floor."""


class HttpSection(Section):
    """The vLLM/OpenAI-compatible HTTP front door; off unless `port` is set. It binds the proxy's `host`, takes the
    proxy's `[auth]` tokens as `Authorization: Bearer` (generate role for sampling, admin for adapters) and serves TLS
    with the proxy's `[tls]` certificate."""

    port: int = Field(default=-1, ge=-1, le=65535)
    """HTTP port; -1 = no HTTP door (the default), 0 = a free port (written to the ready file as http_port)."""
    model_path: str = Field(default="")
    """The base model's local folder: its tokenizer renders chat templates and names tokens in logprobs, its config
    gives max_model_len, and its path string is accepted as a `model` name (TRL sends it). Empty: text and token-id
    completions still work (the replicas tokenize); chat completions are refused with a sentence."""
    served_model_name: str = Field(default="")
    """The base model's id in /v1/models and responses; empty = the model folder's name (or "base" without one)."""
    adapter_root: str = Field(default="")
    """The only folder whose adapter folders /v1/load_lora_adapter may read by `lora_path` (symlinks resolved); empty =
    loading by path is refused (403) and adapters come by upload (POST /v1/upload_lora_adapter)."""
    max_model_len: int = Field(default=0, ge=0)
    """Longest prompt + completion reported in /v1/models; 0 = the smaller of the model's max_position_embeddings and
    the replicas' max_prompt_tokens + max_new_tokens."""
    dtype: str = Field(default="float32")
    """The weights' dtype /server_info reports when some replica runs an engine server whose dtype the proxy cannot
    see (sglang, vllm); transformers replicas always run float32."""
    max_lora_rank: int = Field(default=512, ge=1)
    """The largest LoRA rank /server_info reports (TRL checks its adapter against it): transformers replicas take any
    rank within spool.max_adapter_bytes; set it to the engine servers' own limit (--max-lora-rank) for sglang or vllm
    replicas."""
    max_body_bytes: int = Field(default=8 << 20, ge=1024)
    """Largest JSON request body; a larger one is refused (413) before it is read."""
    max_prompts: int = Field(default=16, ge=1)
    """Prompts one /v1/completions request may batch (each becomes one group)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of one HTTP generation request (the proxy's routing.request_timeout_s still caps it)."""
    load_answer: Literal["spooled", "committed"] = Field(default="spooled")
    """When /v1/load_lora_adapter and /v1/upload_lora_adapter answer: "spooled", once the version is checked and
    durable in the proxy's spool (the relay to the replicas finishes behind the answer, and a request naming the
    version waits until a replica serves it: TRL's loop does not stand still for the fan-out); "committed", once every
    healthy replica committed it (a gRPC PushAdapter's answer)."""
    max_connections: int = Field(default=4096, ge=1)
    """Connections the door holds at once, from all peers; at most a quarter of the process's soft file-descriptor
    limit (RLIMIT_NOFILE, read at start and logged), so the door never takes the descriptors the gRPC server needs.
    Beyond it new connections wait in the kernel's backlog until one closes. HTTP/1.1 carries one request at a time:
    TRL's rollout worker holds one connection per request in flight (max_inflight_tasks, by default max_staleness x
    samples per step: 256 at the demo's settings)."""
    max_connections_per_peer: int = Field(default=4096, ge=1)
    """Connections one peer IP address may hold at once; a connection beyond it is closed as soon as it is accepted.
    The default lets one trainer use the whole door (a TRL worker is one peer with hundreds of connections); lower it
    where many distinct callers share the door."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds a connection has to send a request's complete headers (a TLS handshake included), from its opening or
    from the end of its previous response; then it is closed."""
    body_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds a request body (JSON or an upload) has to arrive in full once its headers did; then the request is
    refused (400) and its connection closed."""
    max_upload_bytes_in_flight: int = Field(default=0, ge=0)
    """Bytes of /v1/upload_lora_adapter bodies the door holds in memory at once, every upload together (one tenant's
    at most half); an upload that would pass it is refused (429 UPLOADS_FULL) before its bytes are read, each counted
    from its Content-Length or as it arrives. 0 = room for two of the largest uploads (spool.max_adapter_bytes and the
    other files each)."""
    keep_alive_s: float = Field(default=5.0, gt=0)
    """Seconds an idle connection is kept open between requests."""
    pause_max_s: float = Field(default=60.0, gt=0, le=3600)
    """Seconds a tenant's /pause holds its new generation requests at most, if no /resume comes first (http/pause.py):
    a publisher that died mid-sync holds its own tenant for at most this long."""
    pacing_factor: float = Field(default=1.25, ge=0, le=100)
    """Samples a lineage loaded through the door may start per version, as a multiple of what it can train on
    (http/pacing.py: its requests in flight over its window of versions, learned from its loads and unloads); 0 turns
    pacing off. Above 1 leaves a margin for a client that keeps fewer requests in flight than it trains on."""
    pacing_hold_max_s: float = Field(default=0.5, gt=0, le=60)
    """Seconds a paced request waits at most for its lineage's next load before it starts anyway."""
    return_routed_experts: bool = False
    """vLLM's `--enable-return-routed-experts`: every unstreamed answer's choices carry `routed_experts` (the experts a
    MoE model routed each position to, base64 .npy [positions, layers, top_k]) for routing replay. Only for a fleet of
    MoE models on the transformers engine: any other replica refuses such requests (ROUTED_EXPERTS_UNSUPPORTED)."""
    tool_call_parser: Literal["", "hermes", "llama3_json", "qwen3_xml", "qwen3_coder", "mistral"] = Field(default="")
    """How tool calls are read out of a chat sample's text when the request sends `tools` with tool_choice "auto" (its
    default then), as vLLM's `--enable-auto-tool-choice --tool-call-parser NAME` reads them into `message.tool_calls`:
    "hermes", "llama3_json", "qwen3_xml" (= "qwen3_coder"), "mistral" (http/dialect/toolcalls/, one module each),
    checked against http.model_path's tokenizer at start; "" (the default, as vLLM without those flags) refuses
    tool_choice "auto" (400, param tool_choice). The token ids and logprobs of the turn are the sampled ones either
    way (docs/http.md, "Tool calls")."""
    max_tokenizing: int = Field(default=2, ge=1)
    """Chat prompts rendered and tokenized at once (on worker threads, the tokenizer releasing the GIL); more wait."""
    tokenizing_bytes_per_client: int = Field(default=4 * MiB, ge=1024)
    """Bytes of chat text one client may have waiting for or in tokenization; a request beyond it is refused (429)."""


class PeeringSection(DialSection):
    """How this proxy keeps its peer proxies' spools in step with its own (`peers` lists them), and how it dials them:
    each dial setting left empty here is upstream's."""

    timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of sending one adapter version to one peer proxy; a peer over it is marked behind (the push still
    succeeds) and caught up when it answers again."""
    interval_s: float = Field(default=1.0, gt=0)
    """Seconds between health checks of each peer; a peer found answering after a failure (or a dropped connection) is
    sent every spooled version it may lack."""
    hold_s: float = Field(default=5.0, ge=0)
    """After a peer sent a version, requests for the latest version of its name wait (up to their own deadline) until a
    replica here serves it, so versions never go backwards for a client that switches proxies. The sender commits it on
    the replicas; if no replica serves it after this long, this proxy catches them up to it itself."""
    token_file: str = Field(default="")
    """Bearer token sent to peer proxies (the `peer` role there: in their auth.peer_tokens_file); empty =
    upstream.token_file."""
    server_name: str = Field(default="")
    """Name to check peer proxies' certificates against; empty = upstream.server_name."""


class ProxyConfig(ServerConfig):
    """The routing proxy: one GeneratorService and AdminService address for many generator replicas."""

    port: int = port_field(50050, "gRPC")
    metrics_port: int = port_field(9401, "Prometheus /metrics")
    proxy_id: str = Field(default="")
    """Name in logs, status and peering (unique among peers); defaults to proxy@host:port, with the machine's hostname
    for a host bound to every address (0.0.0.0, ::)."""
    policy: Annotated[str, POLICIES] = Field(default="least-loaded")
    """Routing policy, a name registered in rollwire.proxy.policies: least-loaded (power of two choices), round-robin,
    affinity (consistent hash) or prefix (where the prompt's longest recently served prefix went)."""
    generators: list[str] = Field(default_factory=list)
    """Static replicas, HOST:PORT each."""
    discover: str = Field(default="")
    """dns:///NAME:PORT re-resolved periodically (e.g. a Kubernetes headless service)."""
    discover_interval_s: float = Field(default=10.0, gt=0)
    """Seconds between DNS resolutions."""
    base_model: str = Field(default="")
    """Fingerprint of the base model every replica must serve (sha256:..., as `rollwire status` shows it); a replica
    serving another is refused membership. Empty = the one the spooled versions' manifests agree on, else the one the
    first push names; never learned from a replica."""
    routing: RoutingSection = Field(default_factory=RoutingSection)
    score: ScoreSection = Field(default_factory=ScoreSection)
    proof: ProofSection = Field(default_factory=ProofSection)
    health: HealthSection = Field(default_factory=HealthSection)
    spool: SpoolSection = Field(default_factory=SpoolSection)
    fairness: FairnessSection = Field(default_factory=FairnessSection)
    push: PushSection = Field(default_factory=PushSection)
    upstream: UpstreamSection = Field(default_factory=UpstreamSection)
    peers: list[str] = Field(default_factory=list)
    """Other proxies serving the same replicas, HOST:PORT or dns:///NAME:PORT: each pushed version is in their spools
    before the push returns (publish/peers.py); this proxy itself may be listed."""
    peering: PeeringSection = Field(default_factory=PeeringSection)
    http: HttpSection = Field(default_factory=HttpSection)
    registration: RegistrationSection = Field(default_factory=RegistrationSection)
    floor: FloorSection = Field(default_factory=FloorSection)
    tenants: list[TenantSection] = Field(default_factory=list)
    """Tenants sharing the fleet, each with its own adapter names, tokens, weight and quotas (proxy/tenants.py,
    docs/deploy.md "Tenants"); empty = one flat namespace, every token the fleet's."""

    @model_validator(mode="after")
    def _tenants(self) -> ProxyConfig:
        check_tenants(self.tenants, self.auth.enabled())
        return self

    @model_validator(mode="after")
    def _own_credentials(self) -> ProxyConfig:
        """What the proxy sends its replicas is no credential it accepts (audit 2026-12-07 S2): every
        replica holds it, so a replica must not be able to act at the proxy with it (by path here; by
        content at start: app.check_own_credentials); and a discovered replica, whatever answers the
        name, is never sent upstream.token_file but its own signed token."""
        if self.discover and self.upstream.token_file and not self.upstream.member_signing_key_file:
            raise ValueError(
                "discover is set, so upstream.token_file would be sent to whatever the name resolves to (any pod "
                "the Service selects); set upstream.member_signing_key_file, and auth.member_trust_file on the "
                "replicas, so each replica is dialled with its own token (docs/deploy.md, Credentials)"
            )
        accepted = {f"auth.{role}_tokens_file": path for role, path in self.auth.files().items() if path}
        for index, tenant in enumerate(self.tenants):
            for role, path in tenant.token_files().items():
                if path:
                    accepted[f"tenants[{index}].{role}_tokens_file"] = path
        for setting, path in (
            ("upstream.token_file", self.upstream.token_file),
            ("upstream.relay_token_file", self.upstream.relay_token_file),
        ):
            same = sorted(k for k, v in accepted.items() if path and v == path)
            if same:
                raise ValueError(
                    f"{setting} is {path!r}, the file of {', '.join(same)}: the replicas hold what the proxy dials them "
                    "with, so it must be no token this proxy accepts; give the replicas a token of their own "
                    "(docs/deploy.md, Credentials)"
                )
        return self

    @field_validator("base_model")
    @classmethod
    def _base_model(cls, value: str) -> str:
        from rollwire.common.fingerprint import check_fingerprint

        return check_fingerprint(value)

    @field_validator("generators")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        return [check_address(a) for a in value]

    @field_validator("peers")
    @classmethod
    def _peers(cls, value: list[str]) -> list[str]:
        return [check_target(p) for p in value]

    @field_validator("discover")
    @classmethod
    def _dns(cls, value: str) -> str:
        if value:
            parse_dns_target(value)
        return value
