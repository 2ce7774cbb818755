#include "radixkv/node_arena.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace radixkv {

struct NodeArena::Slab {
  char* base;
  size_t bytes;
  size_t block;
  int cls;
  uint32_t capacity;
  uint32_t live = 0;
  uint32_t bumped = 0;  // blocks handed out from the untouched end so far
  void* free_list = nullptr;
  Slab* prev = nullptr;
  Slab* next = nullptr;
  bool kept_empty = false;  // empty, and counted in empty_kept_
};

namespace {

constexpr size_t kAlign = 32;
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kMinSlab = size_t{64} << 10;
// Empty slabs kept for reuse, at most this many bytes in all.
constexpr size_t kKeepEmpty = size_t{16} << 20;

size_t RoundUp(size_t x, size_t to) { return (x + to - 1) / to * to; }

size_t PowerOfTwoAtLeast(size_t x) {
  size_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

size_t SystemAlignment(size_t bytes) { return bytes >= kHugePage ? kHugePage : kAlign; }

size_t SystemBytes(size_t bytes) { return RoundUp(bytes, SystemAlignment(bytes)); }

// Memory from the system (through operator new, so allocation failures can
// be injected in tests); 2 MiB-aligned and advised for huge pages when it
// spans whole huge pages, so the kernel can back it with them.
void* SystemAlloc(size_t bytes) {
  void* p = ::operator new (SystemBytes(bytes), std::align_val_t{SystemAlignment(bytes)});
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= kHugePage) madvise(p, SystemBytes(bytes), MADV_HUGEPAGE);
#endif
  return p;
}

void SystemFree(void* p, size_t bytes) noexcept {
  ::operator delete (p, std::align_val_t{SystemAlignment(bytes)});
}

}  // namespace

size_t NodeArena::ClassSize(int c) noexcept {
  if (c < kSmallClasses) return 32 * static_cast<size_t>(c + 1);
  // Blocks in (2^octave, 2^(octave+1)], in kStepsPerOctave equal steps.
  const int octave = (c - kSmallClasses) / kStepsPerOctave + kFirstOctave;
  const int step = (c - kSmallClasses) % kStepsPerOctave + 1;
  return (size_t{1} << octave) + step * (size_t{1} << (octave - kStepShift));
}

int NodeArena::ClassOf(size_t bytes) noexcept {
  if (bytes <= size_t{1} << kFirstOctave) {
    return bytes == 0 ? 0 : static_cast<int>((bytes - 1) / 32);
  }
  if (bytes > ClassSize(kClasses - 1)) return -1;
  int octave = kFirstOctave;
  while ((size_t{2} << octave) < bytes) ++octave;
  const size_t step = size_t{1} << (octave - kStepShift);
  const int c = kSmallClasses + (octave - kFirstOctave) * kStepsPerOctave +
                static_cast<int>((bytes - (size_t{1} << octave) + step - 1) / step) - 1;
  return c;
}

NodeArena::~NodeArena() {
  // Only empty slabs remain once every block was freed; a slab still in use
  // here (a caller that did not free) is left to the process.
  for (Class& cls : classes_) {
    for (Slab* s = cls.partial; s != nullptr;) {
      Slab* next = s->next;
      if (s->live == 0) {
        SystemFree(s->base, s->bytes);
        delete s;
      }
      s = next;
    }
  }
}

void NodeArena::Link(Class* cls, Slab* slab) noexcept {
  slab->prev = nullptr;
  slab->next = cls->partial;
  if (cls->partial != nullptr) cls->partial->prev = slab;
  cls->partial = slab;
}

void NodeArena::Unlink(Class* cls, Slab* slab) noexcept {
  if (slab->prev != nullptr) slab->prev->next = slab->next;
  if (slab->next != nullptr) slab->next->prev = slab->prev;
  if (cls->partial == slab) cls->partial = slab->next;
  slab->prev = slab->next = nullptr;
}

NodeArena::Slab* NodeArena::NewSlab(int c) {
  Class& cls = classes_[c];
  const size_t block = ClassSize(c);
  if (cls.next_slab == 0) {
    cls.next_slab = std::clamp(PowerOfTwoAtLeast(8 * block), kMinSlab, kHugePage);
  }
  const size_t bytes = std::max(cls.next_slab, block);
  auto slab = std::make_unique<Slab>();
  slab->base = static_cast<char*>(SystemAlloc(bytes));  // on failure `slab` is freed
  slab->bytes = SystemBytes(bytes);
  slab->block = block;
  slab->cls = c;
  slab->capacity = static_cast<uint32_t>(slab->bytes / block);
  // Nothing can fail from here on.
  reserved_ += slab->bytes;
  cls.next_slab = std::min(bytes * 2, std::max(kHugePage, 4 * block));
  Link(&cls, slab.get());
  return slab.release();
}

void NodeArena::ReleaseSlab(Slab* slab) noexcept {
  reserved_ -= slab->bytes;
  SystemFree(slab->base, slab->bytes);
  delete slab;
}

NodeArena::Block NodeArena::Allocate(size_t bytes) {
  const int c = ClassOf(bytes);
  if (c < 0) {
    void* p = SystemAlloc(bytes);
    reserved_ += SystemBytes(bytes);
    return Block{p, nullptr};
  }
  Class& cls = classes_[c];
  Slab* slab = cls.partial != nullptr ? cls.partial : NewSlab(c);
  void* p;
  if (slab->free_list != nullptr) {
    p = slab->free_list;
    slab->free_list = *static_cast<void**>(p);
  } else {
    p = slab->base + slab->bumped++ * slab->block;
  }
  if (slab->kept_empty) {
    slab->kept_empty = false;
    empty_kept_ -= slab->bytes;
  }
  if (++slab->live == slab->capacity) Unlink(&cls, slab);
  return Block{p, slab};
}

void NodeArena::Free(Block block, size_t bytes) noexcept {
  if (block.data == nullptr) return;
  Slab* slab = block.slab;
  if (slab == nullptr) {
    SystemFree(block.data, bytes);
    reserved_ -= SystemBytes(bytes);
    return;
  }
  Class& cls = classes_[slab->cls];
  *static_cast<void**>(block.data) = slab->free_list;
  slab->free_list = block.data;
  const bool was_full = slab->live == slab->capacity;
  --slab->live;
  if (was_full) Link(&cls, slab);
  // An empty slab goes back to the system, unless it is its class's only one
  // with room and the kept ones are few: then it stays for the class's next
  // block, so a class that frees and allocates in turn does not thrash.
  if (slab->live == 0) {
    if (cls.partial == slab && slab->next == nullptr && empty_kept_ + slab->bytes <= kKeepEmpty) {
      empty_kept_ += slab->bytes;
      slab->kept_empty = true;
    } else {
      Unlink(&cls, slab);
      ReleaseSlab(slab);
    }
  }
}

}  // namespace radixkv
