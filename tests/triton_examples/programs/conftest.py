"""Triton's example programs are run as programs, never collected as tests
(memory_growth_test.py would be, by its name)."""

collect_ignore_glob = ["*.py"]
