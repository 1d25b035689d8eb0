"""meshtrain benchmarks: one script per question, each printing a table and
writing JSON with the machine it ran on to benchmarks/results/.

Each script appends the repository root to ``sys.path`` (``append``, not
``insert(0, ...)``): ahead of the standard library the root's ``operator/``
(meshtrain.operator's source) would shadow the standard library's
``operator``, in the script's own fresh imports and in torch.compile's
worker processes, which take ``sys.path`` as their PYTHONPATH.
"""
