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
  Slab* next = nullptr;  // (in the spare list: the next spare slab)
  bool kept_empty = false;  // empty, and counted in empty_kept_
};

namespace {

constexpr size_t kAlign = 32;
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kMinSlab = size_t{64} << 10;
// Empty slabs kept for reuse: at most this many bytes in all, or for spare
// huge slabs an eighth of the bytes in use where that is more.
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
  while (spare_ != nullptr) {
    Slab* next = spare_->next;
    SystemFree(spare_->base, spare_->bytes);
    delete spare_;
    spare_ = next;
  }
}

bool NodeArena::MayKeep(size_t bytes) const noexcept {
  return empty_kept_ + bytes <= std::max(kKeepEmpty, (reserved_ - empty_kept_) / 8);
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
  Slab* slab;
  if (bytes == kHugePage && spare_ != nullptr) {
    // A spare huge slab, emptied by any class: its memory is touched already.
    slab = spare_;
    spare_ = slab->next;
    empty_kept_ -= slab->bytes;
    *slab = Slab{slab->base, slab->bytes, 0, 0, 0};
  } else {
    auto fresh = std::make_unique<Slab>();
    fresh->base = static_cast<char*>(SystemAlloc(bytes));  // on failure `fresh` is freed
    fresh->bytes = SystemBytes(bytes);
    slab = fresh.release();
    reserved_ += slab->bytes;
  }
  // Nothing can fail from here on.
  slab->block = block;
  slab->cls = c;
  slab->capacity = static_cast<uint32_t>(slab->bytes / block);
  cls.next_slab = std::min(bytes * 2, std::max(kHugePage, 4 * block));
  Link(&cls, slab);
  return slab;
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
    TrimSpares();
    return;
  }
  Class& cls = classes_[slab->cls];
  *static_cast<void**>(block.data) = slab->free_list;
  slab->free_list = block.data;
  const bool was_full = slab->live == slab->capacity;
  --slab->live;
  if (was_full) Link(&cls, slab);
  // An empty slab goes back to the system unless the kept ones are few: a
  // huge one then becomes a spare for any class's next slab, and a smaller
  // one stays with its class if it is the class's only one with room, so a
  // class that frees and allocates in turn does not thrash, nor do the
  // classes a workload moves between (the kernel clears each huge page it
  // gives anew: 2 MiB a fault).
  if (slab->live == 0) {
    if (slab->bytes == kHugePage && MayKeep(slab->bytes)) {
      Unlink(&cls, slab);
      slab->next = spare_;
      spare_ = slab;
      empty_kept_ += slab->bytes;
    } else if (cls.partial == slab && slab->next == nullptr &&
               empty_kept_ + slab->bytes <= kKeepEmpty) {
      empty_kept_ += slab->bytes;
      slab->kept_empty = true;
    } else {
      Unlink(&cls, slab);
      ReleaseSlab(slab);
    }
    TrimSpares();
  }
}

void NodeArena::TrimSpares() noexcept {
  // Fewer bytes in use: spares past the budget go back.
  while (spare_ != nullptr && !MayKeep(0)) {
    Slab* spare = spare_;
    spare_ = spare->next;
    empty_kept_ -= spare->bytes;
    ReleaseSlab(spare);
  }
}

}  // namespace radixkv
