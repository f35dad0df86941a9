// matepoint's allocator as torch's CUDA allocator, past malloc and free.
//
// torch's CUDAPluggableAllocator throws for memory_stats, snapshots,
// out-of-memory observers and the rest. This unit subclasses it (malloc,
// free, record_stream, init and empty_cache keep going to the library's C
// entry points), overrides what it can answer from the library's table
// (torch_bridge.h) and installs itself with changeCurrentAllocator. It only
// converts between torch's C++ structs and the table's C types: figures
// and records are made in C. Where an entry of the table is NULL the
// override falls back to the base class, whose message names the
// unsupported call. Compiled at run time against the running torch
// (matepoint/_adapter.py), like oom_raise.cpp.
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include "torch_bridge.h"

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;

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

class Adapter final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
  public:
    explicit Adapter(const matepoint_torch_bridge *bridge)
        : CUDAPluggableAllocator(bridge->malloc, bridge->free), bridge_(bridge)
    {
        set_init_fn(bridge->init);
        set_reset_fn(bridge->empty_cache);
        set_record_stream_fn(bridge->record_stream);
        set_memory_fraction_fn(bridge->set_memory_fraction);
    }

    DeviceStats getDeviceStats(c10::DeviceIndex device) override
    {
        if (bridge_->device_stats == nullptr)
            return CUDAPluggableAllocator::getDeviceStats(device);
        alloc_device_stats from;
        TORCH_CHECK(bridge_->device_stats(device, &from) == 0,
                    "matepoint's allocator has no CUDA device ", static_cast<int>(device));
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

    double getMemoryFraction(c10::DeviceIndex device) override
    {
        if (bridge_->get_memory_fraction == nullptr)
            return CUDAPluggableAllocator::getMemoryFraction(device);
        return bridge_->get_memory_fraction(device);
    }

    void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override
    {
        if (bridge_->set_oom_observer == nullptr)
            return CUDAPluggableAllocator::attachOutOfMemoryObserver(std::move(observer));
        std::lock_guard<std::mutex> guard(observers_lock_);
        observers_.push_back(std::move(observer));
        bridge_->set_oom_observer(&Adapter::notify_oom, this);
    }

    std::string name() override { return "matepoint"; }

  private:
    // The library calls this after releasing its locks, before it throws
    // torch's OutOfMemoryError; the observers run in attach order, as
    // torch's allocator runs them.
    static void notify_oom(void *self, int device, uint64_t allocated, uint64_t total,
                           uint64_t free_bytes)
    {
        auto *adapter = static_cast<Adapter *>(self);
        std::vector<cca::OutOfMemoryObserver> observers;
        {
            std::lock_guard<std::mutex> guard(adapter->observers_lock_);
            observers = adapter->observers_;
        }
        for (auto &observer : observers)
            observer(device, allocated, total, free_bytes);
    }

    const matepoint_torch_bridge *bridge_;
    std::mutex observers_lock_;
    std::vector<cca::OutOfMemoryObserver> observers_;
};

void
write_error(char *out, size_t n, const std::string &text)
{
    if (out == nullptr || n == 0)
        return;
    std::strncpy(out, text.c_str(), n - 1);
    out[n - 1] = '\0';
}

}  // namespace

// Makes an adapter over the library's table (`get_bridge`, the library's
// matepoint_alloc_torch_bridge) torch's current CUDA allocator. 0, or -1
// with the reason in `error` (nothing installed): a table of another
// version, or torch refusing the swap (its allocator already initialized).
extern "C" __attribute__((visibility("default"))) int
matepoint_torch_adapter_install(const matepoint_torch_bridge *(*get_bridge)(void), char *error,
                                size_t error_size)
{
    const matepoint_torch_bridge *bridge = get_bridge ? get_bridge() : nullptr;
    if (bridge == nullptr || bridge->version != MATEPOINT_TORCH_BRIDGE_VERSION ||
        bridge->size != sizeof(matepoint_torch_bridge)) {
        write_error(error, error_size,
                    "the allocator library's table is of another version than the adapter "
                    "(a stale build: reinstall matepoint)");
        return -1;
    }
    try {
        torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(
            std::make_shared<Adapter>(bridge));
    } catch (const std::exception &failure) {
        write_error(error, error_size, failure.what());
        return -1;
    }
    return 0;
}
