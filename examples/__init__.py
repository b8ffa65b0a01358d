"""Worked examples (importable as ``examples.*`` from the repository root)."""
