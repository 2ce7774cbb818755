"""The storage tier (L3): page keys and the backends pages are written to and
read from, shared by many serving instances."""

from radixkv.storage.base import MAX_BATCH, StorageBackend
from radixkv.storage.faulty import FaultyStorage
from radixkv.storage.file import FileStorage
from radixkv.storage.keys import config_fingerprint, page_keys, pool_fingerprint
from radixkv.storage.mooncake import MooncakeMaster, MooncakeStorage

__all__ = [
    "MAX_BATCH",
    "FaultyStorage",
    "FileStorage",
    "MooncakeMaster",
    "MooncakeStorage",
    "StorageBackend",
    "config_fingerprint",
    "page_keys",
    "pool_fingerprint",
]
