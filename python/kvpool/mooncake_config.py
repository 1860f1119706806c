"""Mooncake's ``MooncakeConfig`` (``mooncake.mooncake_config``) on kvpool.

The settings of ``MooncakeDistributedStore.setup`` as one object, read from
a JSON file or from Mooncake's environment variables, with Mooncake's field
names, defaults and variable names: programs and tests written for Mooncake
build their store from it unchanged. ``master_server_address`` is kvpool's
master (host:port); ``metadata_server`` and ``device_name`` are passed on
and not needed by kvpool; ``enable_client_http_server`` and
``client_http_port`` are read and kept (kvpool's clients have no HTTP
server of their own: its metrics are on the process's HTTP port).

Checked as Mooncake checks them (its own test file runs against this one,
python/tests/mooncake_upstream): required fields non-empty, sizes not
negative, the protocol a non-empty string, lowercased; a protocol Mooncake
does not name is logged, not refused.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["MooncakeConfig", "DEFAULT_GLOBAL_SEGMENT_SIZE", "DEFAULT_LOCAL_BUFFER_SIZE"]

logger = logging.getLogger(__name__)

#: Mooncake's defaults: 3.125 GiB of segment, 1 GiB of local buffer.
DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200
DEFAULT_LOCAL_BUFFER_SIZE = 1 << 30

_UNIT = {"b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40}
_TRUE = ("true", "1", "yes", "on", "enable")
_FALSE = ("false", "0", "no", "off", "disable")
#: The protocols Mooncake's transfer engine and store name (others are
#: passed on with a warning).
_PROTOCOLS = frozenset({"tcp", "rdma", "efa", "cxl", "ascend", "musa", "nvlink",
                        "nvlink_intra", "hip", "ub", "ubshmem", "maca", "sunrise_link",
                        "rpc_only", "barex", "nvmeof"})
_REQUIRED = ("local_hostname", "metadata_server", "master_server_address")
#: Mooncake's default port of a client's HTTP server.
DEFAULT_CLIENT_HTTP_PORT = 9300


def _size(v) -> int:
    """An int, or a string of a number and an optional unit (powers of
    1024): ``"4gb"``, ``"512 MB"``, ``"1.5g"``."""
    if isinstance(v, bool):
        raise ValueError(f"size {v!r}: not a number of bytes")
    if isinstance(v, int):
        return v
    if not isinstance(v, str):
        return int(v)
    s = v.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    num = num.strip()
    if not num or unit not in _UNIT and unit != "":
        raise ValueError(f"size {v!r}: a number and one of {sorted(_UNIT)} is needed")
    return int(float(num) * _UNIT.get(unit, 1))


#: Mooncake's name for the size parser (its tests import it).
_parse_segment_size = _size


def _flag(v) -> bool:
    if isinstance(v, (bool, int, float)):
        return bool(v)
    if v is None:
        return False
    s = str(v).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE or not s:
        return False
    raise ValueError(f"{v!r} is not a boolean (true/false, 1/0, yes/no, on/off)")


@dataclass
class MooncakeConfig:
    """What ``setup`` takes, field for field."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: Optional[str]
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = DEFAULT_CLIENT_HTTP_PORT

    def __post_init__(self):
        for k in _REQUIRED:
            v = getattr(self, k)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"Invalid {k}: {v!r} (a non-empty string is needed)")
        for k in ("global_segment_size", "local_buffer_size"):
            if getattr(self, k) < 0:
                raise ValueError(f"Invalid {k}: {getattr(self, k)} (at least 0)")
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(f"Invalid protocol: {self.protocol!r} (a non-empty string is "
                             "needed, e.g. 'tcp' or 'rdma')")
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in _PROTOCOLS:
            logger.warning("Unrecognised protocol %r: passed on as given (known: %s)",
                           self.protocol, ", ".join(sorted(_PROTOCOLS)))

    @staticmethod
    def from_file(file_path: str) -> "MooncakeConfig":
        """From a JSON object with ``local_hostname``, ``metadata_server``
        and ``master_server_address`` (required) and the other fields
        (optional; sizes may be strings with units)."""
        with open(file_path) as f:
            c = json.load(f)
        if not isinstance(c, dict):
            raise ValueError(f"{file_path}: a JSON object is needed")
        for k in _REQUIRED:
            if k not in c:
                raise ValueError(f"Missing required config field: {k} (in {file_path})")
        path, tenant = c.get("ssd_offload_path"), c.get("tenant_id")
        return MooncakeConfig(
            local_hostname=c["local_hostname"],
            metadata_server=c["metadata_server"],
            global_segment_size=_size(c.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_size(c.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=c.get("protocol", "tcp"),
            device_name=c.get("device_name", ""),
            master_server_address=c["master_server_address"],
            enable_ssd_offload=_flag(c.get("enable_ssd_offload", False)),
            ssd_offload_path="" if path is None else str(path),
            tenant_id="default" if tenant is None else str(tenant),
            enable_client_http_server=_flag(c.get("enable_client_http_server", False)),
            client_http_port=int(c.get("client_http_port", DEFAULT_CLIENT_HTTP_PORT)),
        )

    @staticmethod
    def load_from_env() -> "MooncakeConfig":
        """From the file ``MOONCAKE_CONFIG_PATH`` names, else from
        ``MOONCAKE_MASTER`` (required then), ``MOONCAKE_LOCAL_HOSTNAME`` (or
        ``LOCAL_HOSTNAME``),
        ``MOONCAKE_TE_META_DATA_SERVER``, ``MOONCAKE_GLOBAL_SEGMENT_SIZE``,
        ``MOONCAKE_LOCAL_BUFFER_SIZE``, ``MOONCAKE_PROTOCOL``,
        ``MOONCAKE_DEVICE``, ``MOONCAKE_OFFLOAD_ENABLED``,
        ``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``, ``MOONCAKE_TENANT_ID``,
        ``MOONCAKE_ENABLE_CLIENT_HTTP_SERVER``, ``MOONCAKE_CLIENT_HTTP_PORT``."""
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path is not None:
            return MooncakeConfig.from_file(path)
        master = os.getenv("MOONCAKE_MASTER")
        if not master:
            raise ValueError("Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor "
                             "'MOONCAKE_MASTER' is set.")
        env = os.getenv
        return MooncakeConfig(
            local_hostname=env("MOONCAKE_LOCAL_HOSTNAME") or env("LOCAL_HOSTNAME", "localhost"),
            metadata_server=env("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=_size(env("MOONCAKE_GLOBAL_SEGMENT_SIZE",
                                          DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_size(env("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=env("MOONCAKE_PROTOCOL", "tcp"),
            device_name=env("MOONCAKE_DEVICE", ""),
            master_server_address=master,
            enable_ssd_offload=_flag(env("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=env("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=env("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=_flag(env("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false")),
            client_http_port=int(env("MOONCAKE_CLIENT_HTTP_PORT", DEFAULT_CLIENT_HTTP_PORT)),
        )
