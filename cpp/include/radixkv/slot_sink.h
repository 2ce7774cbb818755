// Where a call that returns slots writes them.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

namespace radixkv {

/// Where a call writes the slots it returns. Called at most once, with the
/// number of slots, before the call changes anything; returns a buffer of
/// that many int32. It may throw (a failed allocation, say), and then the call
/// changes nothing. A non-owning reference to a callable, like a function_ref:
/// it must outlive the call it is passed to.
class SlotSink {
 public:
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, SlotSink>>>
  SlotSink(F&& f) noexcept  // NOLINT(google-explicit-constructor)
      : ctx_(const_cast<void*>(static_cast<const void*>(&f))),
        fn_([](void* ctx, int64_t n) -> int32_t* {
          return (*static_cast<std::remove_reference_t<F>*>(ctx))(n);
        }) {}

  int32_t* operator()(int64_t n) const { return fn_(ctx_, n); }

  /// The same sink taking page ids instead of slots: a call writes one entry
  /// per page of `page_size` slots, the page's id (its first slot /
  /// page_size; pages are aligned in their pool), and asks for that many.
  SlotSink Pages() const noexcept {
    SlotSink s = *this;
    s.pages_ = true;
    return s;
  }
  /// Whether the sink takes page ids.
  bool pages() const noexcept { return pages_; }

  /// A sink that resizes `*out` to the count and writes there.
  static auto Into(std::vector<int32_t>* out) {
    return [out](int64_t n) {
      out->resize(static_cast<size_t>(n));
      return out->data();
    };
  }

 private:
  void* ctx_;
  int32_t* (*fn_)(void*, int64_t);
  bool pages_ = false;
};

/// Slots a call reads: one per token, or (`pages`) one page id per page of
/// `page_size` slots, page `p` holding slots `p * page_size + [0,
/// page_size)`. A pointer converts to the per-token form.
struct SlotSource {
  SlotSource(const int32_t* data = nullptr, bool pages = false) noexcept  // NOLINT
      : data(data), pages(pages) {}
  const int32_t* data;
  bool pages;
  /// The entry of the token at `pos` (the start of a page in page form).
  const int32_t* At(int64_t pos, int64_t page_size) const noexcept {
    return data + (pages ? pos / page_size : pos);
  }
  /// Entries for `tokens` tokens.
  int64_t Count(int64_t tokens, int64_t page_size) const noexcept {
    return pages ? tokens / page_size : tokens;
  }
};

}  // namespace radixkv
