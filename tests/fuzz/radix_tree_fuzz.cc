// Fuzz target: decodes bytes into operations on a RadixTree and a
// PageAllocator and checks every invariant after each step. radixkv::Error is
// the documented reaction to bad input; anything else (a crash, a sanitizer
// report, another exception, a broken invariant) is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <vector>

#include "radixkv/page_allocator.h"
#include "radixkv/radix_tree.h"
#include "radixkv/status.h"

namespace {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "fuzz invariant broken: %s\n", what);
  std::abort();
}

void Check(bool cond, const char* what) {
  if (!cond) Fail(what);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const int64_t page_size = int64_t{1} << (in.Byte() % 3);  // 1, 2 or 4
  radixkv::RadixTree tree(page_size);
  radixkv::RadixTree other(page_size);
  std::vector<radixkv::Handle> handles;
  std::set<int32_t> stored;  // slots the tree holds, by our own count
  int32_t next_slot = 0;
  std::vector<int32_t> tokens, slots, out;

  auto read_tokens = [&](size_t max_len) {
    tokens.clear();
    const size_t n = in.Byte() % (max_len + 1);
    for (size_t i = 0; i < n; ++i) tokens.push_back(in.Byte() % 4);
  };

  while (!in.empty()) {
    const uint8_t op = in.Byte() % 9;
    try {
      switch (op) {
        case 0: {  // insert with fresh slots, or with hostile ones
          read_tokens(24);
          slots.clear();
          const uint8_t mode = in.Byte() % 4;
          for (size_t i = 0; i < tokens.size(); ++i) {
            if (mode == 0 && !stored.empty()) {
              slots.push_back(*stored.begin());  // already stored
            } else if (mode == 1) {
              slots.push_back(static_cast<int32_t>(in.Byte()) - 8);  // maybe negative/repeated
            } else {
              slots.push_back(next_slot++);
            }
          }
          const int64_t cached =
              tree.InsertPrefix(tokens.data(), slots.data(), static_cast<int64_t>(tokens.size()));
          const int64_t whole = static_cast<int64_t>(tokens.size()) / page_size * page_size;
          Check(cached >= 0 && cached <= whole && cached % page_size == 0, "insert result");
          for (int64_t i = cached; i < whole; ++i) {
            Check(stored.insert(slots[i]).second, "insert stored a slot twice");
          }
          break;
        }
        case 1: {  // match
          read_tokens(24);
          radixkv::Handle h =
              tree.MatchPrefix(tokens.data(), static_cast<int64_t>(tokens.size()), &out);
          Check(h.cached_len == static_cast<int64_t>(out.size()), "match length");
          Check(h.cached_len % page_size == 0, "match not page aligned");
          for (int32_t s : out) Check(stored.count(s) == 1, "match returned an unknown slot");
          if (handles.size() < 16) handles.push_back(h);
          break;
        }
        case 2:
        case 3: {  // lock / unlock a held handle
          if (handles.empty()) break;
          radixkv::Handle& h = handles[in.Byte() % handles.size()];
          op == 2 ? tree.Lock(&h) : tree.Unlock(&h);
          break;
        }
        case 4: {  // evict, sometimes more than there is
          const int64_t size = static_cast<int64_t>(in.Byte()) - 4;
          const int64_t before = tree.evictable_size();
          tree.Evict(size, &out);
          Check(static_cast<int64_t>(out.size()) >= size, "evict freed too little");
          Check(tree.evictable_size() == before - static_cast<int64_t>(out.size()),
                "evictable_size after evict");
          for (int32_t s : out) Check(stored.erase(s) == 1, "evict returned an unknown slot");
          break;
        }
        case 5: {  // a handle of another tree
          if (handles.empty()) break;
          radixkv::Handle h = handles[in.Byte() % handles.size()];
          other.Lock(&h);
          Fail("another tree accepted a foreign handle");
        }
        case 6:
          if (in.Byte() % 8 == 0) {
            tree.Reset();
            stored.clear();
          }
          break;
        case 7: {  // a page allocator round trip
          radixkv::PageAllocator pages(8, page_size);
          pages.Allocate(in.Byte() % 40, &out);
          std::vector<int32_t> back(out);
          if (!back.empty() && in.Byte() % 2) back[in.Byte() % back.size()] += 1;
          pages.Free(back.data(), static_cast<int64_t>(back.size()));
          break;
        }
        default:
          break;
      }
    } catch (const radixkv::Error&) {
      // Rejected input; the checks below prove nothing changed for the worse.
    }
    tree.CheckIntegrity();
    Check(tree.evictable_size() + tree.protected_size() == static_cast<int64_t>(stored.size()),
          "sizes do not add up to the stored slots");
  }
  return 0;
}
