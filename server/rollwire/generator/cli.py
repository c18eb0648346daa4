"""`rollwire generator` and `rollwire proxy`: argument parsing only, imports stay light."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generator",
        help="run a generator replica",
        description="Serve GeneratorService from a local Hugging Face model folder.",
    )
    p.add_argument("--model", help="local HF model folder (config.json, *.safetensors, tokenizer)")
    p.add_argument("--engine", choices=["transformers", "sglang"], help="model backend (default transformers)")
    p.add_argument(
        "--sglang-url", help="with --engine sglang: use the SGLang server at this URL instead of launching one"
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gRPC port (default 50051; 0 picks a free one)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default 9400; 0 picks a free one)")
    p.add_argument("--replica-id", help="name in logs and status (default host:port)")
    p.add_argument("--adapter-window", type=int, help="newest versions of each adapter kept loaded (default 3)")
    p.add_argument("--config", help="TOML file with the generator config")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. limits.max_n=16"
    )
    p.add_argument("--ready-file", help="write {port, metrics_port, pid} as JSON here once serving")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    p.add_argument(
        "--register", metavar="PROXY_ADDR", help="join this routing proxy by itself, with heartbeats (default: off)"
    )
    p.add_argument(
        "--register-ttl",
        type=int,
        metavar="SECONDS",
        help="the proxy forgets this replica this long after its last heartbeat (default 15)",
    )
    p.add_argument(
        "--advertise", metavar="HOST:PORT", help="address the proxy dials to reach this replica (default host:port)"
    )
    p.add_argument(
        "--register-token-file", metavar="FILE", help="admin-role bearer token for a proxy that requires tokens"
    )
    p.add_argument(
        "--register-tls-ca", metavar="PEM", help="roots of the proxy's certificate, for a proxy that listens with TLS"
    )
    p.set_defaults(func=run_generator_command)

    from rollwire.proxy.cli import add_proxy_command

    add_proxy_command(subparsers)


def run_generator_command(args: argparse.Namespace) -> int:
    from rollwire.common.config import ConfigError, dump_config, load_config
    from rollwire.generator.config import GeneratorConfig

    flags = {
        "model": args.model,
        "engine": args.engine,
        "sglang.url": args.sglang_url,
        "host": args.host,
        "port": args.port,
        "metrics_port": args.metrics_port,
        "replica_id": args.replica_id,
        "adapter_window": args.adapter_window,
        "registration.proxy": args.register,
        "registration.ttl_seconds": args.register_ttl,
        "registration.advertise": args.advertise,
        "registration.token_file": args.register_token_file,
        "registration.tls_ca_file": args.register_tls_ca,
    }
    try:
        config = load_config(GeneratorConfig, args.config, args.set, flags)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    if args.dry_run:
        print(dump_config(config), end="")
        return 0
    import asyncio

    from rollwire.common.logs import setup_logging
    from rollwire.generator.app import run_generator

    setup_logging("generator", config.log_level)
    asyncio.run(run_generator(config, args.ready_file, _registration(config)))
    return 0


def _registration(config):
    """The proxy membership asked for in config.registration (or --register), or None."""
    reg = config.registration
    if not reg.proxy:
        return None
    if config.host in ("0.0.0.0", "::", "") and not reg.advertise:
        raise SystemExit(
            f"--register: the proxy cannot dial {config.host!r}; give --advertise HOST:PORT, the address it can reach"
        )
    from pathlib import Path

    from rollwire.generator.registration import Registration
    from rollwire.serving.security import read_tokens

    token = sorted(read_tokens(reg.token_file))[0] if reg.token_file else ""
    try:
        ca = Path(reg.tls_ca_file).read_bytes() if reg.tls_ca_file else None
    except OSError as exc:
        raise SystemExit(f"cannot read registration.tls_ca_file {reg.tls_ca_file}: {exc.strerror}") from None
    return Registration(reg.proxy, reg.advertise, reg.ttl_seconds, token, ca)
