"""Compatibility layers: radixkv behind the names engines already call."""
