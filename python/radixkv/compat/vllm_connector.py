"""The vLLM connector's first module path, kept working:
`"kv_connector_module_path": "radixkv.compat.vllm_connector"` builds the
same `RadixkvConnector` as `radixkv.compat.vllm`."""

from radixkv.compat.vllm.connector import RadixkvConnector

__all__ = ["RadixkvConnector"]
