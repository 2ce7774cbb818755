// Namespace quotas: a namespace's tokens on each tier, counted as nodes gain
// and lose their device and host copies (SetOnDevice, CountHost), and heaps
// of its own eviction candidates kept beside the tree's (Refresh), so its
// least recently used pages can go without touching anyone else's.
#include <utility>
#include <vector>

#include "radix_node.h"
#include "radixkv/radix_tree.h"
#include "radixkv/status.h"

namespace radixkv {

using tree_errors::kInvalid;

RadixTree::Quota* RadixTree::QuotaOf(uint64_t ns) const noexcept {
  if (quotas_.empty()) return nullptr;
  const auto it = quotas_.find(ns);
  return it == quotas_.end() ? nullptr : it->second.get();
}

RadixTree::Quota* RadixTree::RequireQuota(uint64_t ns, const char* what) const {
  Quota* q = QuotaOf(ns);
  RADIXKV_CHECK(q != nullptr, kInvalid, what, ": namespace ", ns, " has no quota");
  return q;
}

void RadixTree::RefreshQuota(Node* x, Quota* q) noexcept {
  const bool device = DeviceEvictable(x);
  if (device != q->heap.Contains(x->id)) {
    device ? q->heap.Push(x->id, Key(x)) : q->heap.Erase(x->id);  // room reserved
  }
  const bool host = x->has_host() && HostEvictable(x);
  if (host != q->host_heap.Contains(x->id)) {
    host ? q->host_heap.Push(x->id, Key(x)) : q->host_heap.Erase(x->id);
  }
}

void RadixTree::SetQuota(uint64_t ns, int64_t device, int64_t host) {
  RADIXKV_CHECK(device >= -1 && host >= -1, kInvalid,
                "quota limits must be >= 0, or -1 for none, got device=", device, " host=", host);
  if (device == -1 && host == -1) {
    quotas_.erase(ns);
    return;
  }
  if (Quota* q = QuotaOf(ns)) {
    q->device_limit = device;
    q->host_limit = host;
    return;
  }
  auto made = std::make_unique<Quota>();
  made->heap.Reserve(nodes_.size() + free_ids_.size());
  made->host_heap.Reserve(nodes_.size() + free_ids_.size());
  Quota* q = made.get();
  quotas_.emplace(ns, std::move(made));  // nothing below throws
  q->device_limit = device;
  q->host_limit = host;
  for (size_t i = 1; i < nodes_.size(); ++i) {
    Node* x = nodes_[i];
    if (x->parent == nullptr || NsOf(x) != ns) continue;
    if (x->on_device) q->device += x->length;
    if (x->has_host()) q->host += x->length;
    RefreshQuota(x, q);
  }
}

std::vector<RadixTree::QuotaUse> RadixTree::Quotas() const {
  std::vector<QuotaUse> out;
  out.reserve(quotas_.size());
  for (const auto& [ns, q] : quotas_) {
    out.push_back(QuotaUse{ns, q->device, q->host, q->device_limit, q->host_limit});
  }
  return out;
}

std::vector<RadixTree::QuotaUse> RadixTree::OverQuota() const {
  std::vector<QuotaUse> out;
  for (const auto& [ns, q] : quotas_) {
    const int64_t device = q->device_limit >= 0 ? q->device - q->device_limit : 0;
    const int64_t host = q->host_limit >= 0 ? q->host - q->host_limit : 0;
    if (device > 0 || host > 0) {
      out.push_back(QuotaUse{ns, std::max<int64_t>(device, 0), std::max<int64_t>(host, 0),
                             q->device_limit, q->host_limit});
    }
  }
  return out;
}

int64_t RadixTree::EvictNamespace(uint64_t ns, int64_t size, SlotSink out) {
  RADIXKV_CHECK(size >= 0, kInvalid, "size must be >= 0, got ", size);
  return EvictDevice(&RequireQuota(ns, "evict")->heap, size, out, true);
}

int64_t RadixTree::EvictHostNamespace(uint64_t ns, int64_t size, SlotSink out) {
  RADIXKV_CHECK(size >= 0, kInvalid, "size must be >= 0, got ", size);
  return EvictHostCopies(&RequireQuota(ns, "evict_host")->host_heap, size, out, true);
}

}  // namespace radixkv
