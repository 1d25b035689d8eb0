"""The local sandbox: a real single-machine cluster.

``python -m meshtrain.sandbox up|down|status|run-example``.  etcd,
kube-apiserver, kube-scheduler and kube-controller-manager
(:mod:`meshtrain.sandbox.controlplane`); containerd, the kubelet, kube-proxy and
CoreDNS in a network namespace of the sandbox's own (:mod:`.node`); the
operator and trainer images built from their Dockerfiles; the chart installed
with helm; Prometheus scraping the pods at their pod IPs.
"""
