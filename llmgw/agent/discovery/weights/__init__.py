"""Model weights on this node's disks and shares: which models are held, complete, and on
which store (formats: completeness from headers; mounts: local or shared, and the share's
identity; scan: walking the weights directories)."""

from llmgw.agent.discovery.weights.formats import Check, check_gguf, check_safetensors
from llmgw.agent.discovery.weights.mounts import (
    SHARED_FS_TYPES,
    MountTable,
    read_mount_table,
    resolve_store,
)
from llmgw.agent.discovery.weights.scan import (
    FileCheckCache,
    carry_over_timed_out,
    scan_weights,
    weights_equal_for_resend,
)

__all__ = [
    "SHARED_FS_TYPES",
    "Check",
    "FileCheckCache",
    "MountTable",
    "carry_over_timed_out",
    "check_gguf",
    "check_safetensors",
    "read_mount_table",
    "resolve_store",
    "scan_weights",
    "weights_equal_for_resend",
]
