"""What the tests share, none of it a test: conftest.py turns what has a lifetime (models,
processes) into fixtures, and test modules import the plain helpers from here, never from
conftest.py or from each other.

- processes.py: starting and stopping real rollwire processes (test defaults over
  rollwire.demo.stack, the one stack starter) and bounded waits on their state;
- wire.py: real LoRA adapters for the tiny model and raw-stub calls over the wire;
- learner.py: running `rollwire learner` and reading what it wrote;
- sglang_double.py: a protocol-level double of SGLang's HTTP server (also run as a program);
- netlab.py: an emulated multi-host network (network namespaces, shaped links) for the
  partition tests and bench/push_netlab.py (also run as a program: `python -m support.netlab`).
"""
