#!/usr/bin/env bash
# The demo (what `make demo` runs): 2 generator replicas, a proxy and the GRPO learner on the
# taught tiny model. Options: --budget-s SECONDS, --replicas N, --set KEY=VALUE (learner config).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m rollwire.demo "$@"
