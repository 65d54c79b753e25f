"""The engine every algorithm plugs into: driver, validation, plans, threads, backend, kernel loader.

Imports no algorithm (``tests/test_layout.py`` enforces it).
"""
