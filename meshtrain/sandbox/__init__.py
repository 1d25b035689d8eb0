"""The local sandbox: a real control plane with simulated GPU nodes on this machine.

``python -m meshtrain.sandbox up|down|status|run-example|logs``.
etcd, kube-apiserver, kube-scheduler and kube-controller-manager are real
(:mod:`meshtrain.controlplane`); the chart's CRD and RBAC are installed with
helm; the operator runs as a local process with the chart's ServiceAccount;
Prometheus (Debian's binary) scrapes the pods.  Only the kubelet is replaced,
by :mod:`.nodeagent`, which registers simulated GPU nodes and runs the
containers of pods bound to them as local processes.

Not a cluster.  It is a development and test harness: images are
not pulled, containers are processes of this machine, nothing is isolated.
"""
