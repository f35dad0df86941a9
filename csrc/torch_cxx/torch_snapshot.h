// torch's memory records and figures made from the library's
// (alloc_history.h, alloc.h): the stacks torch gathers, held as the C side's
// opaque contexts; the history's configuration; segments with their
// blocks; trace entries annotated with checkpoint region and phase, their
// times in torch's clock; torch's DeviceStats; and TorchRecords, the
// adapter's overrides that answer them. Only converts: the records and
// figures are made in C. Included by torch_adapter.cpp alone (one
// translation unit, compiled at run time).
#ifndef MATEPOINT_ALLOC_TORCH_SNAPSHOT_H
#define MATEPOINT_ALLOC_TORCH_SNAPSHOT_H

#include <c10/util/ApproximateClock.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/headeronly/version.h>

#include "alloc/torch_bridge.h"

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

// torch 2.13 sent capture marks (markCaptureBegin/End) and counted each
// private pool's reserved bytes (DeviceStats::reserved_bytes_by_private_pools)
#define MATEPOINT_TORCH_AT_LEAST(major, minor)                                                    \
    (TORCH_VERSION_MAJOR > (major) ||                                                             \
     (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingDeviceAllocator::DeviceStats;

// ---- contexts: torch's gathered stacks as the C side's opaque pointers ----

// One heap cell per gathered stack, counted by the C side's retain and
// release (alloc_history.h); it holds torch's shared_ptr meanwhile, and
// whether torch's recorder gathered it (else it carries only the tag).
struct Context {
    std::atomic<int> references{1};
    std::shared_ptr<c10::GatheredContext> stack;
    bool gathered = false;
};

// torch's context recorder of the last recordHistory, set only when torch
// asked for stacks (context != None); read by any allocating thread.
std::atomic<cca::CreateContextFn> recorder{nullptr};

// "matepoint region 3 forward": how a block's tag reads in a snapshot
std::string
describe_tag(uint64_t tag)
{
    return "matepoint region " + std::to_string(alloc_tag_region(tag)) + " " +
           alloc_tag_phase(tag);
}

// The stack torch's recorder gathers (none when torch asked for none),
// with the block's checkpoint region and phase as its forward traceback:
// the one per-block text torch's snapshot carries into the viewer
// ("forward_frames"), after any anomaly-mode forward traceback torch
// gathered.
void *
gather_context(uint64_t tag)
{
    cca::CreateContextFn gather = recorder.load();
    std::shared_ptr<c10::GatheredContext> stack = gather ? gather() : nullptr;
    bool gathered = stack != nullptr;
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
    context->gathered = gathered;
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

// The stack torch's recorder gathered for `context`, which the caller
// gives back; nullptr when torch asked for none (torch's
// getContextForPointer then has nothing either).
std::shared_ptr<c10::GatheredContext>
take_gathered_stack(void *context)
{
    if (context == nullptr)
        return nullptr;
    auto *cell = static_cast<Context *>(context);
    std::shared_ptr<c10::GatheredContext> stack = cell->gathered ? cell->stack : nullptr;
    release_context(context);
    return stack;
}

int64_t
approximate_time()
{
    return static_cast<int64_t>(c10::getApproximateTime());
}

// torch's recordHistory as the library's configuration: stacks gathered
// only when torch asks for them (`when` past NEVER). A bad action name
// refuses the call before anything changed.
alloc_history_config
history_config(bool enabled, cca::CreateContextFn context_recorder, size_t max_entries,
               cca::RecordContext when, bool clear, const std::vector<std::string> &skip_actions)
{
    uint32_t skip = 0;
    for (const std::string &name : skip_actions) {
        int action = alloc_trace_action(name.c_str());
        TORCH_CHECK(action >= 0, "matepoint's allocator: unknown memory history action '",
                    name, "' in skip_actions (torch's actions: alloc, free_requested, "
                    "free_completed, segment_alloc, segment_free, segment_map, "
                    "segment_unmap, snapshot, oom, annotate)");
        skip |= 1u << action;
    }
    recorder.store(enabled && when != cca::RecordContext::NEVER ? context_recorder : nullptr);
    alloc_history_config config{};
    config.skip = skip;
    config.enabled = enabled;
    config.max_entries = max_entries;
    config.when = static_cast<int>(when);
    config.clear = clear;
    config.gather = gather_context;
    config.retain = retain_context;
    config.release = release_context;
    config.clock = approximate_time;
    return config;
}

// ---- snapshots -------------------------------------------------------------

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

// A trace entry, its time in epoch microseconds (torch converts its
// approximate clock's ticks as it takes a snapshot)
cca::TraceEntry
trace_entry(int device, const alloc_trace_record &r,
            const std::function<time_t(c10::approx_time_t)> &to_ns)
{
    auto action = static_cast<cca::TraceEntry::Action>(r.action);
    bool block_event = r.action == ALLOC_TRACE_ALLOC || r.action == ALLOC_TRACE_FREE_REQUESTED ||
                       r.action == ALLOC_TRACE_FREE_COMPLETED || r.action == ALLOC_TRACE_OOM;
    cca::TraceEntry entry(action, static_cast<c10::DeviceIndex>(device), r.address, r.size,
                          static_cast<cudaStream_t>(r.stream),
                          {static_cast<c10::CaptureId_t>(r.pool_a),
                           static_cast<c10::CaptureId_t>(r.pool_b)},
                          static_cast<c10::approx_time_t>(r.time), stack_of(r.context), "",
                          block_event ? describe_tag(r.tag) : "");
    entry.time_.t_ = to_ns(static_cast<c10::approx_time_t>(r.time)) / 1000;
    return entry;
}

// what torch's snapshot reports of the allocator's settings: matepoint's
// rounding (512 bytes) and no split limit
cca::AllocatorConfigInfo
config_info()
{
    cca::AllocatorConfigInfo info{};
    info.garbage_collection_threshold = 0.0;
    info.max_split_size = SIZE_MAX;
    info.expandable_segments = false;
    info.last_allocator_settings = "matepoint";
    return info;
}

// torch's snapshot of every device the library serves: the segments of
// `mempool` only unless (0, 0), each device's trace if asked
cca::SnapshotInfo
snapshot_info(const matepoint_torch_bridge *bridge, const c10::cuda::MempoolId_t &mempool,
              bool include_traces, c10::ApproximateClockToUnixTimeConverter &clock)
{
    cca::SnapshotInfo result;
    auto to_ns = clock.makeConverter();
    int devices = bridge->device_count();
    for (int device = 0; device < devices; device++) {
        DeviceSnapshot snap(bridge, device, mempool);
        const alloc_snapshot &data = snap.data;
        for (uint64_t i = 0; i < data.segment_count; i++)
            result.segments.push_back(segment_info(device, data, data.segments[i]));
        result.device_traces.emplace_back();
        for (uint64_t i = 0; include_traces && i < data.trace_count; i++)
            result.device_traces.back().push_back(trace_entry(device, data.trace[i], to_ns));
    }
    result.config_metadata = config_info();
    return result;
}

// ---- figures -----------------------------------------------------------------

void
copy_stat(const alloc_stat &from, Stat &to)
{
    to.current = from.current;
    to.peak = from.peak;
    to.allocated = from.allocated;
    to.freed = from.freed;
}

void
copy_array(const alloc_stat (&from)[ALLOC_POOLS], StatArray &to)
{
    // torch's StatType order: AGGREGATE, SMALL_POOL, LARGE_POOL, as ALLOC_POOL_*
    static_assert(ALLOC_POOLS == static_cast<int>(c10::CachingAllocator::StatType::NUM_TYPES),
                  "torch's pools are all, small and large");
    for (int pool = 0; pool < ALLOC_POOLS; pool++)
        copy_stat(from[pool], to[static_cast<size_t>(pool)]);
}

DeviceStats
device_stats_of(const alloc_device_stats &from)
{
    DeviceStats to;
    copy_array(from.arrays[ALLOC_STAT_ALLOCATION], to.allocation);
    copy_array(from.arrays[ALLOC_STAT_SEGMENT], to.segment);
    copy_array(from.arrays[ALLOC_STAT_ACTIVE], to.active);
    copy_array(from.arrays[ALLOC_STAT_INACTIVE_SPLIT], to.inactive_split);
    copy_array(from.arrays[ALLOC_STAT_ALLOCATED_BYTES], to.allocated_bytes);
    copy_array(from.arrays[ALLOC_STAT_RESERVED_BYTES], to.reserved_bytes);
    copy_array(from.arrays[ALLOC_STAT_ACTIVE_BYTES], to.active_bytes);
    copy_array(from.arrays[ALLOC_STAT_INACTIVE_SPLIT_BYTES], to.inactive_split_bytes);
    copy_array(from.arrays[ALLOC_STAT_REQUESTED_BYTES], to.requested_bytes);
    copy_stat(from.oversize_allocations, to.oversize_allocations);
    copy_stat(from.oversize_segments, to.oversize_segments);
    to.num_alloc_retries = from.num_alloc_retries;
    to.num_ooms = from.num_ooms;
    to.num_sync_all_streams = from.num_sync_all_streams;
    to.num_device_alloc = from.num_device_alloc;
    to.num_device_free = from.num_device_free;
    to.max_split_size = from.max_split_size;
    return to;
}

// ---- the adapter's overrides of torch's figures and memory history -----------

// The part of the adapter (torch_adapter.cpp) that answers torch's memory
// statistics, memory history and snapshots from the library's table. Where
// an entry of the table is NULL it keeps the base class's answer.
class TorchRecords : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
  public:
    explicit TorchRecords(const matepoint_torch_bridge *bridge)
        : CUDAPluggableAllocator(bridge->malloc, bridge->free), bridge_(bridge)
    {
    }

    DeviceStats getDeviceStats(c10::DeviceIndex device) override
    {
        if (bridge_->device_stats == nullptr)
            return CUDAPluggableAllocator::getDeviceStats(device);
        alloc_device_stats from;
        TORCH_CHECK(bridge_->device_stats(device, &from) == 0,
                    "matepoint's allocator has no CUDA device ", static_cast<int>(device));
        DeviceStats to = device_stats_of(from);
#if MATEPOINT_TORCH_AT_LEAST(2, 13)
        std::vector<alloc_pool_figures> pools(16);
        int count = bridge_->pool_figures(device, pools.data(), static_cast<int>(pools.size()));
        if (count > static_cast<int>(pools.size())) {      // more pools: ask again
            pools.resize(static_cast<size_t>(count));
            count = bridge_->pool_figures(device, pools.data(), count);
        }
        for (int i = 0; i < count && i < static_cast<int>(pools.size()); i++)
            copy_array(pools[i].reserved, to.reserved_bytes_by_private_pools[pool_id(pools[i])]);
#endif
        return to;
    }

    void resetPeakStats(c10::DeviceIndex device) override
    {
        if (bridge_->reset_peaks == nullptr)
            return CUDAPluggableAllocator::resetPeakStats(device);
        TORCH_CHECK(bridge_->reset_peaks(device) == 0,
                    "matepoint's allocator has no CUDA device ", static_cast<int>(device));
    }

    void resetAccumulatedStats(c10::DeviceIndex device) override
    {
        if (bridge_->reset_accumulated == nullptr)
            return CUDAPluggableAllocator::resetAccumulatedStats(device);
        TORCH_CHECK(bridge_->reset_accumulated(device) == 0,
                    "matepoint's allocator has no CUDA device ", static_cast<int>(device));
    }

    void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                       size_t alloc_trace_max_entries, cca::RecordContext when,
                       bool clear_history, const std::vector<std::string> &skip_actions) override
    {
        if (bridge_->configure_history == nullptr)
            return CUDAPluggableAllocator::recordHistory(enabled, context_recorder,
                                                         alloc_trace_max_entries, when,
                                                         clear_history, skip_actions);
        alloc_history_config config = history_config(
            enabled, context_recorder, alloc_trace_max_entries, when, clear_history, skip_actions);
        bridge_->configure_history(&config);
    }

    bool isHistoryEnabled() override
    {
        if (bridge_->history_enabled == nullptr)
            return CUDAPluggableAllocator::isHistoryEnabled();
        return bridge_->history_enabled() != 0;
    }

#if MATEPOINT_TORCH_AT_LEAST(2, 12)
    // torch.cuda.memory._allocation_traceback: the stack the live block at
    // `ptr` was allocated with, if torch's recorder gathered one
    std::shared_ptr<c10::GatheredContext> getContextForPointer(const void *ptr) override
    {
        if (bridge_->block_context == nullptr)
            return CUDAPluggableAllocator::getContextForPointer(ptr);
        return take_gathered_stack(bridge_->block_context(const_cast<void *>(ptr)));
    }
#endif

    cca::SnapshotInfo snapshot(c10::cuda::MempoolId_t mempool, bool include_traces) override
    {
        if (bridge_->take_snapshot == nullptr || bridge_->device_count == nullptr)
            return CUDAPluggableAllocator::snapshot(mempool, include_traces);
        return snapshot_info(bridge_, mempool, include_traces, clock_);
    }

    // What the history does not keep (docs/guides/allocator.md says why):
    // said once, where torch would record it, as torch's allocators say it
    // of what they do not support; a raise would stop the user's code
    void recordAnnotation(const std::vector<std::pair<std::string, std::string>> &) override
    {
        TORCH_WARN_ONCE("matepoint's allocator does not record record_function annotations "
                        "(_record_memory_history(global_record_annotations=True)): they will "
                        "not appear in memory snapshots");
    }

    void pushCompileContext(std::string &) override
    {
        TORCH_WARN_ONCE("matepoint's allocator does not record torch.compile's context in the "
                        "memory history (_record_memory_history(compile_context=True)): it will "
                        "not appear in memory snapshots");
    }

#if !MATEPOINT_TORCH_AT_LEAST(2, 14)
    // torch 2.14 warns so itself (its base class names the allocator)
    void setUserMetadata(const std::string &) override
    {
        TORCH_WARN_ONCE("matepoint's allocator does not record user metadata "
                        "(torch.cuda.memory._set_memory_metadata): its trace entries carry each "
                        "allocation's checkpoint region and phase there instead");
    }
#endif

  protected:
    static c10::cuda::MempoolId_t pool_id(const alloc_pool_figures &pool)
    {
        return {static_cast<c10::CaptureId_t>(pool.pool_a),
                static_cast<c10::CaptureId_t>(pool.pool_b)};
    }

    const matepoint_torch_bridge *bridge_;
    // torch's approximate clock against the wall clock, taken at install as
    // torch's allocator takes it: trace times become epoch microseconds
    c10::ApproximateClockToUnixTimeConverter clock_;
};

}  // namespace

#endif
