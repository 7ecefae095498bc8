"""KV transfer between instances and to host memory (vLLM V1's KV connectors): disaggregated
prefill / decode and KV offloading. base.py has the API the scheduler and model runner call;
`create_connector` builds the one `--kv-transfer-config` names."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.config import KVTransferConfig
    from jaxserve.distributed.kv_transfer.base import BlockLayout, KVConnectorBase

# name -> "module:class" (imported on use); SharedStorageConnector is ExampleConnector's old name.
CONNECTORS = {
    "ExampleConnector": "example_connector:ExampleConnector",
    "SharedStorageConnector": "example_connector:ExampleConnector",
    "ZmqConnector": "zmq_connector:ZmqConnector",
    "OffloadingConnector": "offloading_connector:OffloadingConnector",
}


def create_connector(
    config: KVTransferConfig, layout: BlockLayout, engine_index: int = 0
) -> KVConnectorBase:
    import importlib

    module, cls = CONNECTORS[config.kv_connector].split(":")
    mod = importlib.import_module(f"jaxserve.distributed.kv_transfer.{module}")
    return getattr(mod, cls)(config, layout, engine_index)
