"""Shared by every test layer. ``tome`` and ``tome_harness`` are installed (editable) by scripts/setup.sh; the
commands in scripts/ that tests import are on the path through pytest's ``pythonpath`` (pyproject.toml)."""
