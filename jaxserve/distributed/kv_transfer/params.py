"""A request's kv_transfer_params, checked where requests enter the engine (the frontend's
InputProcessor): only the shape `jaxserve proxy` sends and ZmqConnector hands back, and a
remote KV source only on a host `--kv-transfer-allowed-hosts` lists.

    prefill instance: {"do_remote_decode": true, "do_remote_prefill": false, ...}
    decode instance:  {"do_remote_prefill": true, "remote_host": "10.0.0.5",
                       "remote_port": 14579, "remote_engine_id": "...", ...}

Without the allow-list any client could point a consumer's KV fetch at any host and port.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

# A DNS name is at most 253 characters; an engine id is a uuid hex or a user's short name.
_Host = Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_EngineId = Annotated[str, msgspec.Meta(max_length=256)]


class KVTransferParams(msgspec.Struct, forbid_unknown_fields=True):
    """The fields of vLLM's P/D kv_transfer_params that jaxserve's connectors read;
    remote_block_ids is sent by the proxy (always null: blocks are found by hash)."""

    do_remote_decode: bool = False  # to a producer: keep this prompt's KV for a decoder
    do_remote_prefill: bool = False  # to a consumer: fetch the prompt's KV from remote_host
    remote_engine_id: _EngineId | None = None
    remote_block_ids: None = None
    remote_host: _Host | None = None
    remote_port: _Port | None = None


def validate_kv_transfer_params(
    params: Any, allowed_hosts: tuple[str, ...] | list[str]
) -> dict[str, Any]:
    """`params` (a copy: the fields sent, each of KVTransferParams' type), or ValueError
    naming what is wrong: a field of another type or range, an unknown field, a remote
    prefill without its host and port, or a host not in `allowed_hosts`
    (--kv-transfer-allowed-hosts)."""
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    try:
        checked = msgspec.convert(params, KVTransferParams)
    except msgspec.ValidationError as e:
        raise ValueError(f"kv_transfer_params: {e}") from None
    if checked.do_remote_prefill and checked.do_remote_decode:
        raise ValueError("kv_transfer_params: do_remote_prefill and do_remote_decode are exclusive")
    if checked.do_remote_prefill and (checked.remote_host is None or checked.remote_port is None):
        raise ValueError("kv_transfer_params: do_remote_prefill needs remote_host and remote_port")
    host = checked.remote_host
    if host is not None and host.lower() not in {h.lower() for h in allowed_hosts}:
        raise ValueError(
            f"kv_transfer_params remote_host {host!r} is not allowed: this server fetches KV "
            f"only from --kv-transfer-allowed-hosts ({', '.join(allowed_hosts) or 'none'}); "
            "for prefill instances on other hosts, start it with --kv-transfer-allowed-hosts "
            "listing their kv_ip addresses"
        )
    return dict(params)
