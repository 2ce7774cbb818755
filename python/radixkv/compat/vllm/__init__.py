"""radixkv inside vLLM: `RadixkvConnector`, a KV connector over radixkv's host
tier and store (`--kv-transfer-config` with `"kv_connector":
"RadixkvConnector", "kv_connector_module_path": "radixkv.compat.vllm"`).
The package: `connector` (the class vLLM builds: a dispatcher),
`scheduler` and `worker` (its two halves), `metadata` (what they tell each
other), `config` (the extra config), `metrics` (vLLM's stats and
`/metrics`). Only `connector` and what it reads need vLLM: `config` does
not, so the package imports without it."""

from typing import Any

__all__ = ["RadixkvConnector"]


def __getattr__(name: str) -> Any:
    if name == "RadixkvConnector":
        from radixkv.compat.vllm.connector import RadixkvConnector

        return RadixkvConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
