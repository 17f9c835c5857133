"""Benchmarks of the DDTree engine, each beside its baseline in one run (figures of record: docs/benchmarks.md)."""
