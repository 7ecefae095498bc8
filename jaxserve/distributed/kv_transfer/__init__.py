"""KV transfer between instances and to host memory (vLLM V1's KV connectors): disaggregated
prefill / decode and KV offloading. base.py has the API the scheduler and model runner call;
`create_connector` builds the one `--kv-transfer-config` names, from the "module:Class" that
config/kv_transfer.py's KV_CONNECTORS registers for it (vLLM's KVConnectorFactory)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jaxserve.config.kv_transfer import KV_CONNECTORS

if TYPE_CHECKING:
    from jaxserve.config import KVTransferConfig
    from jaxserve.distributed.kv_transfer.base import BlockLayout, KVConnectorBase


def connector_class(name: str) -> type[KVConnectorBase]:
    """The class of the connector registered as `name` (a key of KV_CONNECTORS), its module
    imported now."""
    module, cls = KV_CONNECTORS[name].split(":")
    return getattr(importlib.import_module(f"jaxserve.distributed.kv_transfer.{module}"), cls)


def create_connector(
    config: KVTransferConfig, layout: BlockLayout, engine_index: int = 0
) -> KVConnectorBase:
    """The connector `config.kv_connector` names (KVTransferConfig checked the name)."""
    return connector_class(config.kv_connector)(config, layout, engine_index)
