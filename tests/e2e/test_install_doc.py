"""docs/install.md against the sandbox: the cluster path users follow, from a registry.

1. The sandbox's own start went through its registry: the operator's pod runs the image named
   under the registry (``registry.ALIAS``, which the nodes' containerd maps to the registry's
   address), and the registry's log shows the nodes fetching the operator's, the trainer's and
   the pause image's manifests (from a node's address, not the host's).
2. The page's blocks marked ``install-test`` run in order (``tests/install_doc.py``): ``make
   release`` to the sandbox's registry, ``helm upgrade --install`` from ``oci://``, and the first
   job, which must reach Succeeded; its pods' kubelets pulled the trainer image by the
   registry's address (``Pulling image`` events), the operator rolled to the address's image.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from meshtrain.api import release
from meshtrain.sandbox import example, publish, registry, supervisor
from meshtrain.sandbox.controlplane import binaries
from tests import install_doc
from tests.e2e.test_sandbox import _events
from tests.e2e.test_sandbox import sandbox as sandbox  # the module's own sandbox, up once

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

MAX_LOG_BYTES = 50_000_000
JOB = "sandbox-dp2-pp2"
"""The page's first job (manifests/examples/sandbox-dp2-pp2.yaml, namespace default)."""
BLOCK_SECONDS = 2700


def _node_fetches(paths: supervisor.Paths, host: str) -> set[str]:
    """Repositories whose manifests the registry served to anyone but the host (the nodes)."""
    text = (paths.logs / "registry.log").read_text(errors="replace")[-MAX_LOG_BYTES:]
    fetched = set()
    for line in text.splitlines():
        uri = re.search(r'http\.request\.uri="?/v2/(\S+?)/manifests/', line)
        remote = re.search(r'http\.request\.remoteaddr="?([0-9.]+):', line)
        if uri and remote and remote.group(1) != host and "http.response.status=200" in line:
            fetched.add(uri.group(1))
    return fetched


def _held(state: dict, name: str) -> list[str]:
    """The digests under which each node's containerd holds image ``name`` ("" where it has none)."""
    ctr = binaries.locate_node().ctr
    digests = []
    for node in supervisor.node_states(state):
        listed = subprocess.run(
            [
                str(ctr),
                "--address",
                node["socket"],
                "-n",
                "k8s.io",
                "images",
                "ls",
                f"name=={name}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.splitlines()[1:]
        digests.append(listed[0].split()[2] if listed else "")
    return digests


def test_the_nodes_pull_the_sandbox_images_from_its_registry(
    sandbox: tuple[supervisor.Paths, dict],
) -> None:
    """Nothing imports images any more: a node holds one under the registry's name only by pulling it.

    The image stores are shared between sandboxes, so an unchanged image was pulled by an
    earlier one (the registry's log shows the nodes' requests when this sandbox pulled).
    """
    paths, state = sandbox
    address = state["registry"]
    names = registry.images()
    pods = json.loads(
        example.kubectl(paths, "get", "pods", "-n", supervisor.NAMESPACE, "-o", "json")
    )["items"]
    assert {c["image"] for p in pods for c in p["spec"]["containers"]} == {names.operator}
    node = pods[0]["spec"]["nodeName"]
    slot = [n["name"] for n in supervisor.node_states(state)].index(node)
    for name in (names.operator, names.pause):
        digest = publish.manifest_digest(address, name)
        assert _held(state, name)[slot] == digest, (name, digest)
    print(
        f"manifests the nodes fetched from the registry: {sorted(_node_fetches(paths, address.rpartition(':')[0]))}"
    )


def _only_operator(paths: supervisor.Paths, image: str, timeout: float = 180.0) -> None:
    """Until the release namespace's only pod is an operator running ``image``."""
    deadline = time.monotonic() + timeout
    images: list[str] = []
    while time.monotonic() < deadline:
        pods = json.loads(
            example.kubectl(paths, "get", "pods", "-n", supervisor.NAMESPACE, "-o", "json")
        )["items"]
        images = [c["image"] for p in pods for c in p["spec"]["containers"]]
        if images == [image]:
            return
        time.sleep(1)
    raise AssertionError(f"the operator did not roll to {image}: pods run {images}")


def _run(name: str, body: str, env: dict[str, str], paths: supervisor.Paths) -> None:
    """One block in a shell of its own; stops it early when the page's job has Failed (its wait would not)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", body],
        cwd=install_doc.REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    failed = None
    while proc.poll() is None and failed is None and time.monotonic() - started < BLOCK_SECONDS:
        time.sleep(5)
        job = example.job(paths, "default", JOB) if name == "job" else None
        if job and job.get("status", {}).get("phase") == "Failed":
            failed = json.dumps(job["status"].get("conditions"), indent=2)
    if proc.poll() is None:
        proc.kill()
    output = proc.communicate()[0]
    print(f"install-test {name}: exit {proc.returncode} in {time.monotonic() - started:.0f}s")
    assert failed is None, f"the page's job failed:\n{failed}"
    assert proc.returncode == 0, f"docs/install.md block {name} failed:\n{body}\n{output[-4000:]}"


def test_install_md_runs_against_the_sandbox(sandbox: tuple[supervisor.Paths, dict]) -> None:
    paths, state = sandbox
    prefix = registry.prefix(state["registry"])
    env = {
        **os.environ,
        "KUBECONFIG": str(paths.kubeconfig),
        # The page's first block exports it for the user's shell; each block runs in a shell of its own.
        "REGISTRY": prefix,
        "PATH": f"{binaries.cache_bin_dir()}:{install_doc.REPO / '.venv' / 'bin'}:{os.environ['PATH']}",
    }
    # The page creates the first job's claim; the sandbox's volume for it stands in for the
    # cluster's ReadWriteMany storage class (the sandbox has no provisioner).
    example.provision_for(paths, namespace="default", claim="sandbox-checkpoints")
    blocks = install_doc.blocks()
    for name in install_doc.ORDER:
        _run(name, install_doc.for_sandbox(name, blocks[name], prefix), env, paths)
        if name == "install":  # the job must meet the new operator, not the one winding down
            _only_operator(paths, f"{prefix}/operator:{release.VERSION}")

    job = example.job(paths, "default", JOB)
    assert job is not None and job["status"]["phase"] == "Succeeded"
    trainer = f"{prefix}/trainer:{release.VERSION}"
    pulling = [e["message"] for e in _events(paths, "default", "Pulling")]
    assert any(trainer in message for message in pulling), pulling
    pulled = [e["message"] for e in _events(paths, "default", "Pulled")]
    assert any(trainer in message and "Successfully pulled" in message for message in pulled)
    operator = json.loads(
        example.kubectl(paths, "get", "deployment", "-n", supervisor.NAMESPACE, "-o", "json")
    )["items"][0]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert operator == f"{prefix}/operator:{release.VERSION}"
