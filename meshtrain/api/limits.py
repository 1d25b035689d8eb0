"""Upper bounds on every size in a TrainingJob that drives the operator's work or memory.

One cluster-wide operator serves every tenant, so no single object may make it loop or
allocate without bound.  These numbers are the schema's ``maximum`` (rendered into the
CRD, checked by the API server) and :mod:`meshtrain.api.loading`'s, so ``kubectl apply``,
``meshtrain validate`` and ``meshtrain plan`` give one verdict.  They sit well above any
training run on record; raise one only together with a benchmark of the planning it drives.
"""

from __future__ import annotations

MAX_WORLD_SIZE = 65_536
"""GPUs (ranks) in one job: data x pipeline x context x tensor."""

MAX_DATA = MAX_WORLD_SIZE
"""Data-parallel degree."""

MAX_PIPELINE = 512
"""Pipeline stages."""

MAX_TENSOR = 64
"""Tensor-parallel degree (a tensor group stays inside one NVLink domain)."""

MAX_CONTEXT = 256
"""Context-parallel degree: ranks one sequence is split over (a ring of this many ranks per layer)."""

MAX_VIRTUAL_STAGES = 64
"""Model chunks per pipeline rank (interleaved-1f1b)."""

MAX_MICRO_BATCHES = 4_096
"""Micro-batches per step per replica: the pipeline schedule the planner and trainer walk has
``pipeline x microBatches x virtualStages`` entries."""

MAX_GPUS_PER_NODE = 64
"""GPUs in one pod (one node slot); the largest GPU servers hold 16."""

MAX_LAYERS = 1_024
"""Transformer blocks (the largest published decoders have about 130)."""

MAX_HIDDEN = 65_536
"""Model width, and the rank of powersgd's gradient approximation (Llama 3.1 405B is 16384 wide)."""

MAX_FFN_HIDDEN = 262_144
"""MLP inner width (Llama 3.1 405B: 53248)."""

MAX_HEADS = 1_024
"""Attention heads and key/value heads."""

MAX_VOCAB = 1_048_576
"""Vocabulary size (the largest published tokenizers have about 256k entries)."""

MAX_SEQ_LEN = 1_048_576
"""Sequence length in tokens (and RoPE's original context length)."""

MAX_STEPS = 100_000_000
"""Optimizer steps, and every count of steps (warmup, intervals, windows)."""

MAX_GLOBAL_BATCH = 16_777_216
"""Sequences per optimizer step (also microBatch, referenceBatch)."""

MAX_EVAL_BATCHES = 100_000
"""Global batches per evaluation."""

MAX_SECONDS = 315_360_000
"""Any duration in seconds (deadlines, TTLs, timeouts): ten years."""

MAX_COUNT = 10_000
"""Small counts a job repeats: restarts, checkpoints kept, replacements, skips in a row."""

MAX_COUNTED_PODS = MAX_COUNT + 1
"""Pods ``status.recovery.countedPods`` lists: the operator keeps at most
``runPolicy.recovery.inPlaceLimit + 1`` (past that many restarted pods the gang is rebuilt)."""

MAX_SPARE_NODES = 1_024
"""Nodes one job keeps reserved as spares (``runPolicy.recovery.spareNodes``); placement sizes its
search with them (one spare per 16 pods of the largest world is 256)."""

MAX_REJOIN_SECONDS = 86_400
"""How long ranks may wait at a rendezvous round (``runPolicy.recovery.rejoinTimeoutSeconds``): a day."""

MAX_SEED = 2**32 - 1
"""Random seed: 32 bits, what every generator the trainer seeds accepts (NumPy's included; the
API server keeps schema bounds as floats, so 2**63 - 1 would not survive there)."""

MAX_BUCKET_MB = 65_536.0
"""Gradient all-reduce bucket in MiB (64 GiB)."""

MAX_STRING_LENGTH = 4_096
"""Any string the spec does not bound more tightly (paths, commands, annotation values)."""

MAX_NODE_NAME_LENGTH = 253
"""A Node's name (a DNS subdomain): longer is no node's, and is dropped rather than cut."""
MAX_RECOVERY_NODES = 2
"""Nodes a recovery record's ``nodes`` lists (the trainer's record, its copy in the progress
document, ``status.recovery.last.nodes``): two records of two stay inside the 4 KiB document."""
MAX_POD_NAME_LENGTH = 63
"""A pod name that is also its hostname (a DNS label): a replacement's ``<job>-r<a>-<i>-p<n>``."""

MAX_UID_LENGTH = 128
"""A Kubernetes object UID (36 characters today) as a status field carries it."""

MAX_IMAGE_LENGTH = 1_024
"""A container image reference."""

MAX_URL_LENGTH = 2_048
"""An endpoint URL (``spec.objectStorage.endpoint``)."""

MAX_TRACKER_NAME_LENGTH = 256
"""An MLflow experiment or run name (``spec.tracking.mlflow``)."""

MAX_WANDB_PROJECT_LENGTH = 128
"""A W&B project name (W&B's own limit)."""

MAX_WANDB_ENTITY_LENGTH = 64
"""A W&B user or team name."""

MAX_LIST_LENGTH = 64
"""Lists the spec does not bound more tightly (tolerations, fabric levels, data sources,
node selector and label maps)."""

MAX_DECLARED_FEATURES = 1_024
"""Most entries of a Node's ``status.declaredFeatures`` the operator reads."""

MAX_DOCUMENT_BYTES = 1_048_576
"""A TrainingJob file (the API server refuses objects over about 1.5 MiB; the spec is a few KiB)."""

MAX_DOCUMENT_DEPTH = 32
"""Nesting of mappings and lists in a TrainingJob file (the spec nests six deep)."""

MAX_DOCUMENT_NODES = 100_000
"""Scalars, mappings and lists in a TrainingJob file, aliases expanded: an alias bomb stops here."""

MAX_YAML_DOCUMENTS = 32
"""YAML documents (``---``) in one file ``meshtrain validate`` reads (a TrainingJob and the objects
it needs, such as a PersistentVolumeClaim, as ``kubectl apply -f`` takes them)."""

MAX_VALIDATE_FILES = 64
"""Files one ``meshtrain validate`` checks."""

MAX_DRA_SELECTORS = 32
"""CEL selectors of ``resources.dra`` (the API server's own limit on one request's selectors)."""

MAX_DRA_SELECTOR_LENGTH = 10_240
"""Characters of one CEL selector (the API server's own limit on a selector expression)."""

MAX_QUOTED = 80
"""Characters of a user's value an error message quotes; the rest is elided."""

MAX_HF_JSON_BYTES = 16 * 1_048_576
"""A Hugging Face directory's ``config.json`` or ``model.safetensors.index.json`` (a few KiB;
a 400-shard index under 1 MiB)."""

MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
"""The JSON header of one ``*.safetensors`` file (the safetensors library's own limit)."""

MAX_HF_FILES = 4_096
"""``*.safetensors`` files a ``model.init.fromHF`` directory holds (a 405B model ships 191)."""

MAX_PATH_MATCHES = 100_000
"""Files a dataset glob is walked for when ``meshtrain validate`` checks that it matches one."""

MAX_POD_OVERRIDE_BYTES = 65_536
"""``spec.podTemplateOverride.spec`` as JSON: every key and scalar counted (a pod spec of a few
sidecars and volumes is a few KiB)."""

MAX_POD_OVERRIDE_CONTAINERS = 16
"""Containers and init containers (sidecars included) a pod template override adds or merges."""

MAX_POD_OVERRIDE_VOLUMES = 64
"""Volumes a pod template override adds."""

MAX_POD_ANNOTATION_BYTES = 65_536
"""Keys and values of ``spec.pod.annotations`` and ``spec.podTemplateOverride.metadata.annotations``
together (the API server takes 256 KiB of annotations per object; the operator adds its own)."""

# Dynamic Resource Allocation (issue #39): the operator's reads of ResourceSlices, ResourceClaims
# and DeviceClasses, bounded as resource.k8s.io/v1 validation bounds them.
MAX_DEVICES_PER_SLICE = 128
"""Devices read from one ResourceSlice (resource.k8s.io/v1's limit)."""

MAX_DEVICE_FIELDS = 32
"""Attributes plus capacities read from one device (resource.k8s.io/v1's limit)."""

MAX_CLASS_SELECTORS = 32
"""Selectors read from one DeviceClass (resource.k8s.io/v1's limit)."""

MAX_CLAIM_RESULTS = 32
"""Allocated devices read from one ResourceClaim (resource.k8s.io/v1's limit)."""

MAX_EVALUATED_SELECTOR_LENGTH = 1_024
"""Longest CEL selector the operator evaluates itself (a longer one is left to kube-scheduler)."""

MAX_EVALUATED_SELECTORS_CHARS = 4_096
"""Characters of a request's selectors, its class's included, the operator evaluates on a device
(more: the verdict is left to kube-scheduler)."""

MAX_CEL_CHARS_PER_NODE = 32_768
"""Selector characters the operator evaluates for one node's devices in one verdict (verdicts
remembered for devices alike are free); past it the node's verdict is left to kube-scheduler."""

MAX_CEL_SECONDS_PER_PASS = 0.5
"""Seconds of CEL evaluation one placement pass spends on tenant selectors (all nodes together);
past it the nodes not judged yet are left to kube-scheduler (the pass runs on the event loop)."""

MAX_CLUSTER_FILE_BYTES = 256 * 1_048_576
"""Largest ``meshtrain plan --cluster`` file read (``kubectl get nodes,resourceslices -o yaml`` of
a large cluster)."""

MAX_CLUSTER_OBJECTS = 200_000
"""Most Kubernetes objects read from one cluster file."""

MAX_GANG_SCHEDULE_TIMEOUT_SECONDS = 3_600
"""``--gang-schedule-timeout-seconds``: how long a coscheduled pod may wait in the second
scheduler's Permit for its siblings, holding its node's resources in that scheduler's cache."""

# Small files a tenant controls that the trainer reads whole (issue #33): each is read at most this
# many bytes, and a larger one is refused with its name, its size and the bound.
MAX_TOKEN_METADATA_BYTES = 16 * 1_048_576
"""``FILE.bin.json``, the metadata ``meshtrain data prepare`` writes beside a token file (a few
hundred bytes and the input paths: 100,000 inputs of 100 characters are 10 MiB)."""

MAX_SCAN_RECORD_BYTES = 65_536
"""A vocabulary scan's record of a token file (``FILE.bin.scan.json`` or the cache's): under 1 KiB."""

MAX_CHECKPOINT_MARKER_BYTES = 64 * 1_048_576
"""A checkpoint's ``COMPLETE`` marker: a line of about 150 bytes per file it lists (one file per
rank: 65,536 ranks make about 10 MiB)."""

MAX_LOG_TAIL_BYTES = 1_048_576
"""Bytes read from the end of a rank's log to quote its last lines when the rank fails."""
