"""Small stdlib-only helpers every layer may use (waiting with a deadline, free ports, redacting secrets).

This package sits below every other one (tests/test_layout.py): it imports nothing from ``pd``.
"""
