"""``spec.objectStorage``: the S3-compatible store that ``s3://`` URLs of the spec name.

``training.dataset(s)``, ``training.eval.dataset``, ``model.init.fromHF`` and ``checkpoint.path``
accept ``s3://bucket/key`` URLs; this section says where the store is and where its credentials
are. The operator hands the credentials to the pods as ``secretKeyRef`` environment variables
(it never reads the Secret) and the rest as plain variables (:func:`client_environment`); the
trainer's :mod:`meshtrain.trainer.storage` builds its s3fs client from that environment alone,
so ``meshtrain run`` on a workstation takes the keys from the user's own environment.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshtrain.api import limits
from meshtrain.api.spec import base, kube_names

ENDPOINT_PATTERN = r"^https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?/?$"
"""``http(s)://host[:port]`` (an IPv6 literal in brackets): the store's S3 API, no path, no credentials."""
ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
"""Key of the credentials Secret holding the access key id (and the variable it becomes)."""
SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"
"""Key of the credentials Secret holding the secret key (and the variable it becomes)."""
SESSION_TOKEN = "AWS_SESSION_TOKEN"
"""Optional key of the credentials Secret: a session token of temporary credentials."""
ADDRESSING_ENV = "MESHTRAIN_S3_ADDRESSING_STYLE"
"""The trainer's variable for :attr:`ObjectStorage.addressing_style` (botocore reads none)."""
CA_MOUNT_DIR = "/etc/meshtrain/object-storage-ca"
"""Where the operator mounts :attr:`ObjectStorage.ca_config_map` read-only."""
CA_KEY = "ca.crt"
"""Key of the CA ConfigMap holding the PEM bundle."""
CA_VOLUME = "object-storage-ca"
"""The volume of :attr:`ObjectStorage.ca_config_map` in every pod."""
OPERATOR_ENV = (
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_CA_BUNDLE",
    ACCESS_KEY_ID,
    SECRET_ACCESS_KEY,
    SESSION_TOKEN,
)
"""Variables the operator sets from this section (besides ``MESHTRAIN_*``): a job sets none."""


class ObjectStorage(base.SpecModel):
    """An S3-compatible object store (AWS S3, MinIO, Ceph RGW, versitygw, ...)."""

    endpoint: str | None = Field(
        None,
        max_length=limits.MAX_URL_LENGTH,
        pattern=ENDPOINT_PATTERN,
        description="The store's S3 API, e.g. https://minio.storage:9000; empty: AWS S3 of region.",
    )
    region: str = Field(
        "us-east-1",
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9-]+$",
        description="Region the requests are signed for (S3-compatible stores mostly accept any).",
    )
    credentials_secret: kube_names.ClaimName | None = Field(
        None,
        description=f"Secret in the job's namespace with keys {ACCESS_KEY_ID} and {SECRET_ACCESS_KEY} "
        f"(and optionally {SESSION_TOKEN}), given to the trainer as environment variables; empty: "
        "the pod's own identity (IRSA, an instance profile) or, for meshtrain run, the environment.",
    )
    addressing_style: Literal["path", "virtual", "auto"] = Field(
        "path",
        description="path (https://endpoint/bucket/key: MinIO, Ceph, versitygw) or virtual "
        "(https://bucket.endpoint/key: AWS S3); auto lets botocore choose.",
    )
    ca_config_map: kube_names.ClaimName | None = Field(
        None,
        description=f"ConfigMap whose key {CA_KEY} holds the PEM CA bundle the endpoint's TLS "
        "certificate is verified against (a private CA); empty: the image's system CAs.",
    )


def client_environment(storage: ObjectStorage) -> dict[str, str]:
    """The plain (non-secret) variables from which a trainer builds its S3 client."""
    env = {
        "AWS_REGION": storage.region,
        "AWS_DEFAULT_REGION": storage.region,
        ADDRESSING_ENV: storage.addressing_style,
    }
    if storage.endpoint:
        env["AWS_ENDPOINT_URL"] = storage.endpoint.rstrip("/")
    if storage.ca_config_map:
        env["AWS_CA_BUNDLE"] = f"{CA_MOUNT_DIR}/{CA_KEY}"
    return env
