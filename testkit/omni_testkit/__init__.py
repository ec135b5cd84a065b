"""What the tests (tests/) and the benchmarks (bench/) share: port leases, a stage client's
outputs read to their end, an OTLP collector, the model families' own diffusers pipelines
as references, and BAGEL's reference inference run in its own environment.

Its own package, beside the product's (runtime/, operator/) and never in their
distribution: no image ships it, and an import-linter contract keeps omni_runtime and
omni_operator from importing it. bench/ imports it instead of modules of tests/ (a test
module's fixtures and test functions are no library; tests/unit/test_bench_imports.py
keeps it so). scripts/setup.sh puts this directory's parent on the venv's path, so every
process of the venv (pytest and the processes it starts, bench scripts, lint-imports, mypy)
imports it as it imports omni_runtime.
"""
