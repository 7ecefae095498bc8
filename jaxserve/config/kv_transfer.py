"""KV transfer's configuration (`--kv-transfer-config`, vLLM's fields) and the connector names."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jaxserve.config.json_flag import json_object

logger = logging.getLogger(__name__)

# The KV connectors, by the name `kv_connector` gives: "module:Class" under
# jaxserve/distributed/kv_transfer/, imported only when `create_connector` builds one (vLLM's
# KVConnectorFactory registry), so validating a name imports no connector.
# SharedStorageConnector is ExampleConnector's old name.
KV_CONNECTORS = {
    "ExampleConnector": "example_connector:ExampleConnector",
    "SharedStorageConnector": "example_connector:ExampleConnector",
    "ZmqConnector": "zmq_connector:ZmqConnector",
    "OffloadingConnector": "offloading_connector:OffloadingConnector",
}
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# Where a request's kv_transfer_params may send a consumer for its KV (remote_host), unless
# --kv-transfer-allowed-hosts says otherwise: this machine only.
DEFAULT_KV_TRANSFER_ALLOWED_HOSTS = ("127.0.0.1", "::1", "localhost")


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector (`--kv-transfer-config`, vLLM's fields; distributed/kv_transfer/):
    kv_producer instances save the KV of the prompts they compute, kv_consumer instances load
    KV instead of recomputing it, kv_both do both. kv_ip / kv_port: where a direct connector's
    producer serves its blocks (port + the engine's data-parallel index). kv_buffer_size:
    bytes of KV a producer keeps for its consumers. kv_load_failure_policy: what a request
    does when its KV cannot be loaded (the producer died, a timeout): recompute it, or fail.
    --kv-offloading-size makes one of connector OffloadingConnector
    (kv_connector_extra_config {"cpu_bytes_to_use": N})."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: float = 1e9
    kv_load_failure_policy: str = "recompute"
    engine_id: str | None = None
    kv_connector_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config kv_connector {self.kv_connector!r} is not supported; "
                f"jaxserve implements {', '.join(KV_CONNECTORS)}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config kv_role {self.kv_role!r} must be one of {', '.join(KV_ROLES)}"
            )
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_transfer_config kv_load_failure_policy {self.kv_load_failure_policy!r} "
                f"must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                "kv_transfer_config kv_connector_extra_config must be an object, got "
                f"{self.kv_connector_extra_config!r}"
            )
        if not 0 < int(self.kv_port) < 65536:
            raise ValueError(f"kv_transfer_config kv_port {self.kv_port!r} is not a port")

    @classmethod
    def parse(cls, config: dict | str) -> KVTransferConfig:
        """From a dict or its JSON (the CLI's string); vLLM fields jaxserve has no use for
        (kv_rank, kv_parallel_size, kv_buffer_device, kv_connector_module_path) are accepted
        and ignored with a warning, unknown ones are an error."""
        config = json_object(config, "kv_transfer_config")
        if "kv_connector" not in config:
            raise ValueError(f"kv_transfer_config needs a kv_connector, got {config!r}")
        config = dict(config)
        ignored = {"kv_rank", "kv_parallel_size", "kv_buffer_device", "kv_connector_module_path"}
        for name in ignored & config.keys():
            logger.warning("kv_transfer_config: %s is not used by jaxserve", name)
            config.pop(name)
        fields = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(config.keys() - fields):
            raise ValueError(f"kv_transfer_config: unknown fields {unknown}")
        return cls(**config)
