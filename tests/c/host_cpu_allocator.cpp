// Test harness: torch's CPU allocator replaced by matepoint's allocator
// library, so torch.empty on the CPU goes through matepoint_malloc as CUDA
// allocations do through CUDAPluggableAllocator, and an out-of-memory error
// reaches Python through torch's own bindings. Either on its host backend
// (device 0, no stream), or over the simulated GPU, where each allocation
// goes to the device and stream current on the calling thread (`where`).
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

namespace {

using malloc_fn = void *(*)(size_t, int, void *);
using free_fn = void (*)(void *, size_t, int, void *);
using where_fn = void (*)(int *, void **);

malloc_fn matepoint_malloc;
free_fn matepoint_free;
where_fn where;
c10::Allocator *previous;

// Device and stream of each live allocation (the free needs them back);
// torch's deleter gets only the pointer.
struct Placement {
    int device;
    void *stream;
};
std::mutex placements_lock;
std::unordered_map<void *, Placement> placements;

void
release(void *ptr)
{
    if (ptr == nullptr)
        return;
    Placement placement{0, nullptr};
    if (where != nullptr) {
        std::lock_guard<std::mutex> guard(placements_lock);
        auto found = placements.find(ptr);
        if (found != placements.end()) {
            placement = found->second;
            placements.erase(found);
        }
    }
    matepoint_free(ptr, 0, placement.device, placement.stream);
}

struct MatepointCPU final : c10::Allocator {
    c10::DataPtr allocate(size_t n) override
    {
        Placement placement{0, nullptr};
        // as c10's own CPU allocator: nothing for an empty tensor (on a GPU,
        // making one launches no kernel)
        if (n == 0 && where != nullptr)
            return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
        if (where != nullptr)
            where(&placement.device, &placement.stream);
        void *ptr = matepoint_malloc(n, placement.device, placement.stream);  // throws on OOM
        if (where != nullptr) {
            std::lock_guard<std::mutex> guard(placements_lock);
            placements[ptr] = placement;
        }
        return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
    }
    c10::DeleterFnPtr raw_deleter() const override { return &release; }
    void copy_data(void *dest, const void *src, std::size_t count) const override
    {
        std::memcpy(dest, src, count);
    }
};

MatepointCPU instance;

}  // namespace

extern "C" __attribute__((visibility("default"))) void
matepoint_test_use_as_cpu_allocator(malloc_fn m, free_fn f)
{
    matepoint_malloc = m;
    matepoint_free = f;
    previous = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&instance, 255);
}

extern "C" __attribute__((visibility("default"))) void
matepoint_test_use_sim_cpu_allocator(malloc_fn m, free_fn f, where_fn w)
{
    where = w;
    matepoint_test_use_as_cpu_allocator(m, f);
}

extern "C" __attribute__((visibility("default"))) void
matepoint_test_restore_cpu_allocator()
{
    c10::SetCPUAllocator(previous, 255);
}
