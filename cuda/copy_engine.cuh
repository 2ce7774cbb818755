// The copy engine of the host tier on a CUDA device: the twin of the CPU
// engine in cpp/src/cache_controller.cc, behind the same CopyEngine interface.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "radixkv/cache_controller.h"
#include "radixkv/transfer_index.h"

namespace radixkv::cuda {

/// Copies between a device pool on CUDA device `device` and a host pool in
/// pinned memory (read and written by the transfer kernel through UVA).
/// Backups run on one copy stream and loads on another, both created here,
/// so neither waits for the forward pass's kernels nor delays them:
/// - Fence (scheduler thread, when a copy is queued) records an event on the
///   compute stream (SetComputeStream); the copy's stream waits for it, so a
///   backup never reads rows the forward pass is still writing and a load
///   never writes pages a kernel queued earlier may still read.
/// - CopyLayers (controller thread) stages the slot lists on the device and
///   launches the transfer kernel (`max_blocks` blocks at most, so it takes
///   few SMs beside the forward pass); a load records one event per layer.
/// - Finish (controller thread) waits for the copy's completion event: the
///   acknowledgement, and with it the pages' release, comes only after the
///   copy has really finished.
/// - AfterLayer (scheduler thread) makes the compute stream wait for the
///   layer's event: attention on layer i waits for layer i only.
/// Every plane (the K/V, then the side buffers) is copied by each CopyLayers.
std::unique_ptr<CopyEngine> MakeCudaCopyEngine(std::vector<CopyPlane> planes, int64_t layers,
                                               int device, int max_blocks = 16);

}  // namespace radixkv::cuda
