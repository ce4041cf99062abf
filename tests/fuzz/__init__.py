"""Fuzzing: malformed inference requests, etcd records and registry addresses (hypothesis).

Default run: 1,000 cases per property (``make test``). Nightly-style run:
``FUZZ_EXAMPLES=10000 .venv/bin/pytest tests/fuzz``.
"""
