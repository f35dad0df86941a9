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
// unsupported call. Built per torch, as oom_raise.cpp: matepoint/_units.py.
#include "single_threaded.h"
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include "alloc/torch_bridge.h"
#include "torch_snapshot.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

class Adapter final : public TorchRecords {
  public:
    explicit Adapter(const matepoint_torch_bridge *bridge) : TorchRecords(bridge)
    {
        set_init_fn(bridge->init);
        set_reset_fn(bridge->empty_cache);
        set_record_stream_fn(bridge->record_stream);
        set_memory_fraction_fn(bridge->set_memory_fraction);
#if MATEPOINT_TORCH_AT_LEAST(2, 13)
        bridge->use_capture_marks();
#endif
        bridge->set_error_handler(&raise_runtime_error);
    }

    // torch drops an allocator it swapped out: the library forgets the
    // trampoline and the handler that point here
    ~Adapter() override
    {
        bridge_->set_oom_observer(nullptr, nullptr);
        bridge_->set_error_handler(nullptr);
    }

    // A stream of another GPU than the block's (t_on_cuda0.record_stream(
    // stream_on_cuda1)): torch's hook passes the stream alone, and an event
    // made on the block's device cannot be recorded there; the library makes
    // it on the stream's device, as torch's insert_events does.
    void recordStream(const c10::DataPtr &ptr, c10::cuda::CUDAStream stream) override
    {
        if (bridge_->record_stream_on == nullptr)
            return CUDAPluggableAllocator::recordStream(ptr, stream);
        if (ptr.get() == nullptr)
            return;     // an empty tensor's storage: no block
        TORCH_CHECK(bridge_->record_stream_on(ptr.get(), stream.stream(),
                                              static_cast<int>(stream.device_index())) >= 0,
                    "matepoint's allocator: out of host memory recording a stream on ", ptr.get());
    }

    // torch's allocator refuses a fraction outside [0, 1] (NaN too) and a
    // device it does not serve; torch's hook to the library cannot fail
    void setMemoryFraction(double fraction, c10::DeviceIndex device) override
    {
        TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0,
                    "matepoint's allocator: invalid memory fraction ", fraction,
                    " (a fraction of the device's memory, from 0 to 1)");
        TORCH_CHECK(bridge_->get_memory_fraction(device) >= 0.0,
                    "matepoint's allocator has no CUDA device ", static_cast<int>(device));
        CUDAPluggableAllocator::setMemoryFraction(fraction, device);
    }

    double getMemoryFraction(c10::DeviceIndex device) override
    {
        double fraction = bridge_->get_memory_fraction(device);
        TORCH_CHECK(fraction >= 0.0,
                    "matepoint's allocator has no CUDA device ", static_cast<int>(device));
        return fraction;
    }

    void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override
    {
        if (bridge_->set_oom_observer == nullptr)
            return CUDAPluggableAllocator::attachOutOfMemoryObserver(std::move(observer));
        std::lock_guard<std::mutex> guard(observers_lock_);
        observers_.push_back(std::move(observer));
        bridge_->set_oom_observer(&Adapter::notify_oom, this);
    }

    // ---- CUDA graph pools: torch's filter is a std::function, which C
    // calls through a trampoline; the adapter keeps it alive from begin to
    // end (the library holds its address meanwhile).
    void beginAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                             std::function<bool(cudaStream_t)> filter) override
    {
        if (bridge_->begin_pool == nullptr)
            return CUDAPluggableAllocator::beginAllocateToPool(device, mempool_id,
                                                               std::move(filter));
        auto key = pool_key(device, mempool_id);
        auto owned = std::make_unique<PoolFilter>(std::move(filter));
        PoolFilter *raw = owned.get();
        {
            std::lock_guard<std::mutex> guard(filters_lock_);
            // torch's own check: the library would keep the first filter
            TORCH_CHECK(filters_.find(key) == filters_.end(),
                        "beginAllocateToPool: already recording to mempool_id");
            filters_.emplace(key, std::move(owned));
        }
        int status = bridge_->begin_pool(device, mempool_id.first, mempool_id.second,
                                         &Adapter::use_pool, raw);
        if (status == ALLOC_BEGIN_OK)
            return;
        std::lock_guard<std::mutex> guard(filters_lock_);   // torch will not end it
        filters_.erase(key);
        TORCH_CHECK(false, "matepoint's allocator cannot allocate to memory pool (",
                    mempool_id.first, ", ", mempool_id.second, ") on device ",
                    static_cast<int>(device), ": ", alloc_begin_pool_reason(status));
    }

    void endAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) override
    {
        if (bridge_->end_pool == nullptr)
            return CUDAPluggableAllocator::endAllocateToPool(device, mempool_id);
        bridge_->end_pool(device, mempool_id.first, mempool_id.second);
        std::lock_guard<std::mutex> guard(filters_lock_);   // the library dropped it
        filters_.erase(pool_key(device, mempool_id));
    }

#if MATEPOINT_TORCH_AT_LEAST(2, 13)
    // torch 2.13+ tells a real capture (CUDAGraph's capture_begin and
    // capture_end) apart from pools allocated to outside one (use_mem_pool,
    // NCCL registration, cudagraph trees' warmup): only a capture stops
    // event queries and frees of the ordinary cache
    void markCaptureBegin(c10::DeviceIndex device) override
    {
        bridge_->mark_capture(static_cast<int>(device), 1);
    }

    void markCaptureEnd(c10::DeviceIndex device) override
    {
        bridge_->mark_capture(static_cast<int>(device), 0);
    }
#endif

    void releasePool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) override
    {
        if (bridge_->release_pool == nullptr)
            return CUDAPluggableAllocator::releasePool(device, mempool_id);
        bridge_->release_pool(device, mempool_id.first, mempool_id.second);
    }

    // ---- torch.cuda.MemPool: a pool made (one use) with the MemPool and
    // released at its end; use_mem_pool begins allocating to it (one more
    // use) with a filter of the calling thread. A MemPool serving another
    // allocator's memory (MemPool(allocator=...)) cannot be one of this
    // allocator's pools.
    void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                            std::shared_ptr<cca::CUDAAllocator> allocator) override
    {
        if (bridge_->create_pool == nullptr)
            return CUDAPluggableAllocator::createOrIncrefPool(device, mempool_id,
                                                              std::move(allocator));
        TORCH_CHECK(allocator == nullptr || allocator.get() == this,
                    "matepoint's allocator cannot serve a torch.cuda.MemPool whose memory "
                    "comes from another allocator (MemPool(allocator=...)): make the MemPool "
                    "without allocator=, or run without matepoint.install_allocator()");
        TORCH_CHECK(bridge_->create_pool(device, mempool_id.first, mempool_id.second) == 0,
                    "matepoint's allocator cannot make memory pool (", mempool_id.first, ", ",
                    mempool_id.second, ") on CUDA device ", static_cast<int>(device),
                    ": the pool was released already, or the device or host memory is missing");
    }

    int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) override
    {
        if (bridge_->pool_use_count == nullptr)
            return CUDAPluggableAllocator::getPoolUseCount(device, mempool_id);
        int uses = bridge_->pool_use_count(device, mempool_id.first, mempool_id.second);
        return uses < 0 ? 0 : uses;
    }

    // A MemPool's end turns this off; turning it on is refused: matepoint's
    // allocator never serves other requests from a pool. torch's MemPool
    // constructor, the one caller of both refusals below, made the pool just
    // before and will not end it (no destructor runs after a throw): the
    // refusal gives its use back, so that nothing is left behind.
    void setUseOnOOM(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                     bool use_on_oom) override
    {
        if (use_on_oom)
            refused_pool(device, mempool_id);
        TORCH_CHECK(!use_on_oom,
                    "matepoint's allocator does not serve other allocations from a "
                    "torch.cuda.MemPool when out of memory (MemPool(use_on_oom=True)): make the "
                    "MemPool without use_on_oom, or run without matepoint.install_allocator()");
    }

    void setNoSplit(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) override
    {
        refused_pool(device, mempool_id);
        TORCH_CHECK(false,
                    "matepoint's allocator always splits a pool's segments "
                    "(MemPool(no_split=True) is not supported): make the MemPool without "
                    "no_split, or run without matepoint.install_allocator()");
    }

    // emptyCache of one pool (a MemPool's end) gives back only that pool's
    // free segments, and only once it is released: a pool in use keeps
    // them, as a graph may replay into them.
    void emptyCache(c10::cuda::MempoolId_t mempool_id) override
    {
        if (bridge_->empty_pool == nullptr || (mempool_id.first == 0 && mempool_id.second == 0))
            return CUDAPluggableAllocator::emptyCache(mempool_id);
        bridge_->empty_pool(mempool_id.first, mempool_id.second);
    }

    // cudnn.benchmark's workspace bound, as torch's allocator answers it:
    // a zero `largestBlock` first becomes the device's free memory, then the
    // largest cached free block counts if larger.
    void cacheInfo(c10::DeviceIndex device, size_t *largestBlock) override
    {
        if (bridge_->largest_free_block == nullptr)
            return CUDAPluggableAllocator::cacheInfo(device, largestBlock);
        if (*largestBlock == 0) {
            c10::cuda::CUDAGuard guard(device);
            size_t free_bytes = 0, total_bytes = 0;
            C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
            *largestBlock = free_bytes;
        }
        uint64_t cached = bridge_->largest_free_block(device);
        if (cached > *largestBlock)
            *largestBlock = static_cast<size_t>(cached);
    }

    // ---- CUDA IPC: another process can map only whole segments
    void *getBaseAllocation(void *ptr, size_t *size) override
    {
        if (bridge_->base_allocation == nullptr)
            return CUDAPluggableAllocator::getBaseAllocation(ptr, size);
        uint64_t bytes = 0;
        void *base = bridge_->base_allocation(ptr, &bytes);
        TORCH_CHECK(base != nullptr, "matepoint's allocator: invalid device pointer: ", ptr);
        if (size != nullptr)
            *size = static_cast<size_t>(bytes);
        return base;
    }

    // The segment's IPC handle and the block's offset in it. The handle is
    // the bare cudaIpcMemHandle_t: every torch's receiver reads that form
    // as a cudaMalloc'ed segment (its versioned form differs between torch
    // releases).
    cca::ShareableHandle shareIpcHandle(void *ptr) override
    {
        if (bridge_->base_allocation == nullptr)
            return CUDAPluggableAllocator::shareIpcHandle(ptr);
        void *base = getBaseAllocation(ptr, nullptr);
        cudaIpcMemHandle_t handle;
        C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base));
        return cca::ShareableHandle{static_cast<char *>(ptr) - static_cast<char *>(base),
                                    std::string(reinterpret_cast<const char *>(&handle),
                                                CUDA_IPC_HANDLE_SIZE)};
    }

    // The receiving side: opens a segment shared by another process once
    // per handle (CUDA allows one open per context), closed when the last
    // storage over it goes.
    std::shared_ptr<void> getIpcDevPtr(std::string handle) override
    {
        std::lock_guard<std::mutex> guard(ipc_lock_);
        auto found = ipc_open_.find(handle);
        if (found != ipc_open_.end()) {
            if (auto open = found->second.lock())
                return open;
        }
        cudaIpcMemHandle_t cuda_handle;
        size_t skip = handle.size() == CUDA_IPC_HANDLE_SIZE ? 0 : 2;   // version, type
        TORCH_CHECK(handle.size() == CUDA_IPC_HANDLE_SIZE + skip && (skip == 0 || handle[1] == 'c'),
                    "matepoint's allocator can open only cudaMalloc'ed segments shared by "
                    "another process (not expandable segments)");
        std::memcpy(&cuda_handle, handle.data() + skip, CUDA_IPC_HANDLE_SIZE);
        c10::DeviceIndex device = 0;
        C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
        void *mapped = nullptr;
        C10_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, cuda_handle, cudaIpcMemLazyEnablePeerAccess));
        std::shared_ptr<void> open(mapped, [this, handle, device](void *address) {
            {
                std::lock_guard<std::mutex> erase_guard(ipc_lock_);
                auto it = ipc_open_.find(handle);
                if (it != ipc_open_.end() && it->second.expired())
                    ipc_open_.erase(it);
            }
            c10::cuda::CUDAGuard device_guard(device);
            C10_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(address));
        });
        ipc_open_[handle] = open;
        return open;
    }

    // torch.compile's CUDA graph trees take a pool's state after each
    // recording (getCheckpointState) and set the pool back to one when they
    // switch between recorded graphs (setCheckpointPoolState). The state
    // and its restore are the library's (alloc.h); here torch's
    // CheckpointDelta is made of the pointers it freed and allocated, the
    // latter with this allocator's deleter and book entry, as torch's
    // allocator hands them out.
    std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                            at::cuda::MempoolId_t id) override
    {
        if (bridge_->checkpoint_pool == nullptr)
            return CUDAPluggableAllocator::getCheckpointState(device, id);
        auto state = std::make_shared<PoolState>(bridge_);
        int status = bridge_->checkpoint_pool(device, id.first, id.second, &state->data);
        TORCH_CHECK(status == ALLOC_RESTORE_OK,
                    "matepoint's allocator cannot checkpoint CUDA graph pool (", id.first, ", ",
                    id.second, ") of device ", static_cast<int>(device), ": ",
                    alloc_restore_reason(status));
        return state;
    }

    cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                                std::shared_ptr<cca::AllocatorState> state) override
    {
        if (bridge_->restore_pool == nullptr)
            return CUDAPluggableAllocator::setCheckpointPoolState(device, std::move(state));
        auto *pool = dynamic_cast<PoolState *>(state.get());
        TORCH_CHECK(pool != nullptr && pool->data.device == device,
                    "matepoint's allocator can restore only a state it checkpointed itself, of "
                    "the same device (got one of another allocator, or of another device than ",
                    static_cast<int>(device), ")");
        // The C restore cannot be undone: what the books need is allocated
        // first (spare nodes keyed after it, room bounded by the state's blocks
        // and the books' live pointers), so no bad_alloc can follow a restore.
        const uint64_t blocks = pool->data.block_count;
        decltype(restored_) spare;
        cca::CheckpointDelta result;
        for (size_t i = 0; i < blocks; i++)
            spare.emplace(reinterpret_cast<void *>(i + 1), Restored{});   // distinct keys
        result.dataptrs_allocd.reserve(blocks);
        std::unique_lock<std::mutex> books(allocator_mutex_);
        result.ptrs_freed.reserve(allocation_metadata_.size() + restored_.size());
        restored_.reserve(restored_.size() + blocks);
        books.unlock();
        alloc_pool_delta delta{};
        int status = bridge_->restore_pool(&pool->data, &delta);
        TORCH_CHECK(status == ALLOC_RESTORE_OK,
                    "matepoint's allocator cannot restore CUDA graph pool (", pool->data.pool_a,
                    ", ", pool->data.pool_b, ") of device ", static_cast<int>(device),
                    " to its checkpointed state: ", alloc_restore_reason(status));
        std::unique_ptr<alloc_pool_delta, std::function<void(alloc_pool_delta *)>> owned(
            &delta, [this](alloc_pool_delta *d) { bridge_->free_pool_delta(d); });
        TORCH_INTERNAL_ASSERT(delta.allocated_count <= spare.size() &&
                              delta.freed_count <= result.ptrs_freed.capacity());
        books.lock();
        for (uint64_t i = 0; i < delta.freed_count; i++) {
            allocation_metadata_.erase(delta.freed[i]);
            restored_.erase(delta.freed[i]);
            result.ptrs_freed.push_back(delta.freed[i]);
        }
        for (uint64_t i = 0; i < delta.allocated_count; i++) {
            const alloc_restored_block &b = delta.allocated[i];
            auto node = spare.extract(spare.begin());
            node.key() = b.ptr;
            node.mapped() = Restored{b.size, device, static_cast<cudaStream_t>(b.stream)};
            restored_.insert(std::move(node));
            result.dataptrs_allocd.emplace_back(b.ptr, b.ptr, raw_deleter(),
                                                c10::Device(c10::DeviceType::CUDA, device));
        }
        return result;
    }

    bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                                  const std::unordered_set<void *> &expected) override
    {
        if (bridge_->pool_live_is == nullptr)
            return CUDAPluggableAllocator::checkPoolLiveAllocations(device, mempool_id, expected);
        std::vector<void *> ptrs(expected.begin(), expected.end());
        int same = bridge_->pool_live_is(device, mempool_id.first, mempool_id.second,
                                         ptrs.data(), ptrs.size());
        TORCH_CHECK(same >= 0, "matepoint's allocator has no CUDA graph pool (", mempool_id.first,
                    ", ", mempool_id.second, ") on device ", static_cast<int>(device));
        return same == 1;
    }

    // Zero bytes are no allocation, as in torch's allocator: a null pointer,
    // nothing counted, nothing in torch's book (cudagraph trees tell
    // storages apart by data_ptr() != 0)
    c10::DataPtr allocate(size_t size) override
    {
        if (size != 0)
            return CUDAPluggableAllocator::allocate(size);
        c10::DeviceIndex device = 0;
        C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
        return {nullptr, nullptr, raw_deleter(), c10::Device(c10::DeviceType::CUDA, device)};
    }

    void *raw_alloc(size_t nbytes) override
    {
        return nbytes == 0 ? nullptr : CUDAPluggableAllocator::raw_alloc(nbytes);
    }

    void *raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override
    {
        return nbytes == 0 ? nullptr
                           : CUDAPluggableAllocator::raw_alloc_with_stream(nbytes, stream);
    }

    // A block a restore allocated goes back through the library like any
    // other; torch's book of allocations (allocation_metadata_) cannot take
    // it (its entry type is not exported), so this one keeps it. A null
    // pointer (zero bytes) frees nothing.
    void raw_delete(void *ptr) override
    {
        if (ptr == nullptr)
            return;
        Restored block{};
        {
            std::lock_guard<std::mutex> guard(allocator_mutex_);
            auto found = restored_.find(ptr);
            if (found != restored_.end()) {
                block = found->second;
                restored_.erase(found);
            }
        }
        if (block.size == 0)
            return CUDAPluggableAllocator::raw_delete(ptr);
        bridge_->free(ptr, block.size, block.device, block.stream);
    }

    std::string name() override { return "matepoint"; }

  private:
    // A pool's checkpointed state, torch's opaque AllocatorState.
    struct PoolState final : cca::AllocatorState {
        explicit PoolState(const matepoint_torch_bridge *b) : bridge(b) {}
        ~PoolState() override { bridge->free_pool_state(&data); }
        PoolState(const PoolState &) = delete;
        PoolState &operator=(const PoolState &) = delete;
        const matepoint_torch_bridge *bridge;
        alloc_pool_state data{};
    };

    // a block allocated by a restore: what torch's free entry takes
    struct Restored {
        size_t size;
        c10::DeviceIndex device;
        cudaStream_t stream;
    };

    using PoolFilter = std::function<bool(cudaStream_t)>;
    using PoolKey = std::tuple<int, c10::CaptureId_t, c10::CaptureId_t>;

    static PoolKey pool_key(c10::DeviceIndex device, const c10::cuda::MempoolId_t &id)
    {
        return PoolKey{static_cast<int>(device), id.first, id.second};
    }

    void refused_pool(c10::DeviceIndex device, const c10::cuda::MempoolId_t &id)
    {
        if (bridge_->release_pool != nullptr)
            bridge_->release_pool(device, id.first, id.second);
    }

    // The library's refusals that are no lack of memory (a capture no pool
    // takes, a CUDA error) reach Python as RuntimeError, not as
    // torch.OutOfMemoryError, which retry-smaller code would take for one
    [[noreturn]] static void raise_runtime_error(const char *message)
    {
        TORCH_CHECK(false, message);
        std::abort();   // not reached: TORCH_CHECK(false) throws
    }

    // Called by the library with its lock held: torch's filters only ask
    // CUDA whether the stream captures; an exception cannot cross C.
    static int use_pool(void *filter, void *stream)
    {
        try {
            return (*static_cast<PoolFilter *>(filter))(static_cast<cudaStream_t>(stream)) ? 1 : 0;
        } catch (...) {
            return 0;
        }
    }

    // The library calls this after releasing its locks, before it throws
    // torch's OutOfMemoryError, with torch's figures (the failed device
    // allocation, the device's total or the fraction's cap, its free
    // bytes); the observers run in attach order, as torch's allocator runs
    // them.
    static void notify_oom(void *self, int device, uint64_t alloc_size, uint64_t total,
                           uint64_t free_bytes)
    {
        auto *adapter = static_cast<Adapter *>(self);
        std::vector<cca::OutOfMemoryObserver> observers;
        {
            std::lock_guard<std::mutex> guard(adapter->observers_lock_);
            observers = adapter->observers_;
        }
        for (auto &observer : observers)
            observer(device, alloc_size, total, free_bytes);
    }

    std::mutex observers_lock_;
    std::vector<cca::OutOfMemoryObserver> observers_;
    // the blocks restores allocated, until freed (guarded by the base
    // class's allocator_mutex_, as its own book)
    std::unordered_map<void *, Restored> restored_;
    std::mutex filters_lock_;
    std::map<PoolKey, std::unique_ptr<PoolFilter>> filters_;
    std::mutex ipc_lock_;
    std::unordered_map<std::string, std::weak_ptr<void>> ipc_open_;
};

}  // namespace

#include "torch_entries.h"

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
