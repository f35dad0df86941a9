// Test harness: torch's CPU allocator replaced by matepoint's allocator
// library (its host backend), so torch.empty on the CPU goes through
// matepoint_malloc as CUDA allocations do through CUDAPluggableAllocator,
// and an out-of-memory error reaches Python through torch's own bindings.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstring>

namespace {

using malloc_fn = void *(*)(size_t, int, void *);
using free_fn = void (*)(void *, size_t, int, void *);

malloc_fn matepoint_malloc;
free_fn matepoint_free;
c10::Allocator *previous;

void
release(void *ptr)
{
    matepoint_free(ptr, 0, 0, nullptr);
}

struct MatepointCPU final : c10::Allocator {
    c10::DataPtr allocate(size_t n) override
    {
        void *ptr = matepoint_malloc(n, 0, nullptr);  // throws when out of memory
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
matepoint_test_restore_cpu_allocator()
{
    c10::SetCPUAllocator(previous, 255);
}
