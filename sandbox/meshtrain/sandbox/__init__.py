"""The local sandbox: meshtrain on a real single-machine cluster (``python -m meshtrain.sandbox``).

A control plane (:mod:`.controlplane`), real kubelet nodes in network namespaces of their own
(:mod:`.node`), the operator and trainer images built from their Dockerfiles, the chart installed
with helm, and Prometheus scraping the pods (docs/sandbox.md).
"""
