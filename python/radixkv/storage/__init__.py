"""The storage tier (L3): page keys and the backends pages are written to and
read from, shared by many serving instances."""

from radixkv.storage.keys import config_fingerprint, page_keys

__all__ = ["config_fingerprint", "page_keys"]
