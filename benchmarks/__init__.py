"""meshtrain benchmarks: one script per question, each printing a table and
writing JSON with the machine it ran on to benchmarks/results/.

Run as ``python benchmarks/bench_x.py`` (``python -m benchmarks`` runs them so
too), a script has only ``benchmarks/`` on ``sys.path``: each appends the
repository root to import its helpers (``benchmarks.machine``, ``benchmarks.ranks``,
for some ``tests.*``).  Where the root stands on the path does not matter: no
folder at the root shadows the standard library.
"""
