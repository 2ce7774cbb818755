"""Compatibility layers: radixkv behind the names engines already call.

- `radixkv.compat.minisgl`: mini-SGLang's prefix cache (`create_prefix_cache`,
  `match_prefix`, `insert_prefix`, `lock_handle`, `evict`, `size_info`).
- `radixkv.compat.sglang`: SGLang's own package: 0.5.x's `RadixCache`
  (`match_prefix`, `insert`, `evict`, `inc_lock_ref` / `dec_lock_ref`,
  `cache_finished_req`, `cache_unfinished_req`, `extra_key` namespaces
  included), the `--radix-cache-backend radixkv` plug-in and radixkv's
  storage as HiCache's L3.
- `radixkv.compat.vllm`: vLLM's KV connector over radixkv's host tier and
  storage (`radixkv.compat.vllm_connector`, its first module path, still
  builds it). What adapters share lives below: `radixkv.storage.staged`,
  `radixkv.kvcache.host_pages`.
"""
