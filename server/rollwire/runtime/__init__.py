"""Runtime infrastructure shared by rollwire's processes (replica, proxy, learner), none of it
part of the wire contract: the one config loader, registries, durable files, structured logs,
Prometheus metric factories, bounded waits. The SDK (rollwire.client) imports nothing of it; the
contract (rollwire.common) never imports it (import-linter contracts in pyproject.toml).
"""
