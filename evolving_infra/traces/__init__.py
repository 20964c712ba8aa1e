"""Canonical agent traces: schema, I/O and validation, statistics, converters, generators.

Spec: docs/trace-format.md. Entry points: ``evolving-infra trace validate|stats|convert|generate``.
"""
