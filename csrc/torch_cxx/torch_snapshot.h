// torch's memory-snapshot records made from the library's (alloc_history.h):
// the stacks torch gathers, held as the C side's opaque contexts; segments
// with their blocks; trace entries annotated with checkpoint region and
// phase. Only converts: the records are made in C. Included by
// torch_adapter.cpp alone (one translation unit, compiled at run time).
#ifndef MATEPOINT_ALLOC_TORCH_SNAPSHOT_H
#define MATEPOINT_ALLOC_TORCH_SNAPSHOT_H

#include <c10/util/ApproximateClock.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include "alloc/torch_bridge.h"

#include <atomic>
#include <memory>
#include <string>
#include <utility>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

// ---- contexts: torch's gathered stacks as the C side's opaque pointers ----

// One heap cell per gathered stack, counted by the C side's retain and
// release (alloc_history.h); it holds torch's shared_ptr meanwhile.
struct Context {
    std::atomic<int> references{1};
    std::shared_ptr<c10::GatheredContext> stack;
};

// torch's context recorder of the last recordHistory (a plain function);
// read by any allocating thread.
std::atomic<cca::CreateContextFn> recorder{nullptr};

// "matepoint region 3 forward": how a block's tag reads in a snapshot
std::string
describe_tag(uint64_t tag)
{
    return "matepoint region " + std::to_string(alloc_tag_region(tag)) + " " +
           alloc_tag_phase(tag);
}

// The stack torch's recorder gathers (none without one), with the block's
// checkpoint region and phase as its forward traceback: the one per-block
// text torch's snapshot carries into the viewer ("forward_frames"), after
// any anomaly-mode forward traceback torch gathered.
void *
gather_context(uint64_t tag)
{
    cca::CreateContextFn gather = recorder.load();
    std::shared_ptr<c10::GatheredContext> stack = gather ? gather() : nullptr;
    if (stack == nullptr)
        stack = std::make_shared<torch::CapturedTraceback>();
    auto *traceback = dynamic_cast<torch::CapturedTraceback *>(stack.get());
    if (traceback != nullptr && tag != ALLOC_TAG_NONE) {
        std::vector<std::string> lines = traceback->forward_traceback().value_or(
            std::vector<std::string>{});
        lines.push_back(describe_tag(tag));
        traceback->set_forward_traceback(std::move(lines));
    }
    auto *context = new Context();
    context->stack = std::move(stack);
    return context;
}

void
retain_context(void *context)
{
    static_cast<Context *>(context)->references.fetch_add(1);
}

void
release_context(void *context)
{
    auto *cell = static_cast<Context *>(context);
    if (cell->references.fetch_sub(1) == 1)
        delete cell;
}

std::shared_ptr<c10::GatheredContext>
stack_of(void *context)
{
    return context ? static_cast<Context *>(context)->stack : nullptr;
}

int64_t
approximate_time()
{
    return static_cast<int64_t>(c10::getApproximateTime());
}

// A snapshot of one device, freed (its context references released) at scope exit.
struct DeviceSnapshot {
    const matepoint_torch_bridge *bridge;
    alloc_snapshot data{};
    DeviceSnapshot(const matepoint_torch_bridge *b, int device, const c10::cuda::MempoolId_t &pool)
        : bridge(b)
    {
        TORCH_CHECK(bridge->take_snapshot(device, pool.first, pool.second, &data) == 0,
                    "matepoint's allocator: out of host memory for a memory snapshot");
    }
    ~DeviceSnapshot() { bridge->free_snapshot(&data); }
    DeviceSnapshot(const DeviceSnapshot &) = delete;
    DeviceSnapshot &operator=(const DeviceSnapshot &) = delete;
};

cca::SegmentInfo
segment_info(int device, const alloc_snapshot &data, const alloc_segment_record &seg)
{
    cca::SegmentInfo info;
    info.device = static_cast<c10::DeviceIndex>(device);
    info.address = seg.address;
    info.total_size = seg.size;
    info.stream = seg.stream;
    info.is_large = !seg.small;
    info.owner_private_pool_id = {static_cast<c10::CaptureId_t>(seg.pool_a),
                                  static_cast<c10::CaptureId_t>(seg.pool_b)};
    for (uint64_t i = seg.first_block; i < seg.first_block + seg.block_count; i++) {
        const alloc_block_record &b = data.blocks[i];
        cca::BlockInfo block;
        block.size = b.size;
        block.requested_size = b.requested;
        block.allocated = b.state == ALLOC_BLOCK_ALLOCATED;
        block.active = b.state != ALLOC_BLOCK_INACTIVE;
        block.context_when_allocated = stack_of(b.context);
        info.requested_size += b.requested;
        info.allocated_size += block.allocated ? b.size : 0;
        info.active_size += block.active ? b.size : 0;
        info.blocks.push_back(std::move(block));
    }
    return info;
}

cca::TraceEntry
trace_entry(int device, const alloc_trace_record &r)
{
    auto action = static_cast<cca::TraceEntry::Action>(r.action);
    bool block_event = r.action == ALLOC_TRACE_ALLOC || r.action == ALLOC_TRACE_FREE_REQUESTED ||
                       r.action == ALLOC_TRACE_FREE_COMPLETED || r.action == ALLOC_TRACE_OOM;
    return cca::TraceEntry(action, static_cast<c10::DeviceIndex>(device), r.address, r.size,
                           static_cast<cudaStream_t>(r.stream), {0, 0},
                           static_cast<c10::approx_time_t>(r.time), stack_of(r.context), "",
                           block_event ? describe_tag(r.tag) : "");
}

}  // namespace

#endif
