"""pytest for the whole repository: markers and options live in pyproject.toml.

The checkout's root is on ``sys.path`` (pyproject's ``pythonpath``) so that
tests import ``tests.*`` and ``benchmarks``; no folder at the root is a
package that could shadow the standard library (docs/architecture.md,
"Layout and packaging").
"""
