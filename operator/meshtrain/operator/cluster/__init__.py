"""The operator's cluster I/O: the API client, the informer caches, leadership, writes, the clock.

Every API request goes through :mod:`.kube`; the other modules read the
caches or act on a job's objects through it.
"""
