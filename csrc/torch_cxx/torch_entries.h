// torch's own C++ entry points (c10::cuda::CUDACachingAllocator's free
// functions, which call the current allocator) for C callers and for the
// tests, where torch's Python entries would first initialize CUDA, which a
// machine without a GPU cannot. Each returns 0, or -1 with torch's message
// in `error`. Included by torch_adapter.cpp alone (one translation unit,
// compiled at run time).
#ifndef MATEPOINT_ALLOC_TORCH_ENTRIES_H
#define MATEPOINT_ALLOC_TORCH_ENTRIES_H

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

void
write_error(char *out, size_t n, const std::string &text)
{
    if (out == nullptr || n == 0)
        return;
    std::strncpy(out, text.c_str(), n - 1);
    out[n - 1] = '\0';
}

// Python and TorchScript stacks, as torch's _record_memory_history
// gathers them for context="all"
std::shared_ptr<c10::GatheredContext>
gather_stack()
{
    return torch::CapturedTraceback::gather(true, true, false);
}

}  // namespace

// Attaches `observer` through torch's own C++ entry point (the one
// torch._C._cuda_attach_out_of_memory_observer calls after initializing
// CUDA), so a C caller (and the tests, where CUDA cannot initialize) reach
// the current allocator's attachOutOfMemoryObserver. 0, or -1 with the
// reason in `error` (torch's allocator refused, e.g. the plain pluggable one).
extern "C" __attribute__((visibility("default"))) int
matepoint_torch_adapter_attach_oom_observer(void (*observer)(int64_t device, size_t allocated,
                                                             size_t device_total,
                                                             size_t device_free),
                                            char *error, size_t error_size)
{
    try {
        cca::attachOutOfMemoryObserver(
            [observer](int64_t device, size_t allocated, size_t total, size_t free_bytes) {
                observer(device, allocated, total, free_bytes);
            });
    } catch (const std::exception &failure) {
        write_error(error, error_size, failure.what());
        return -1;
    }
    return 0;
}


// What torch.cuda.memory._record_memory_history(enabled, context="all" or
// None, max_entries, clear_history, skip_actions) does once CUDA is
// initialized: calls the current allocator's recordHistory through torch's
// C++ entry point. torch's own Python entry initializes CUDA first, which a
// machine without a GPU cannot; the tests record history through this.
// `skip` holds `skip_count` action names. 0, or -1 with the reason in `error`.
extern "C" __attribute__((visibility("default"))) int
matepoint_torch_adapter_record_history(int enabled, int stacks, uint64_t max_entries, int clear,
                                       const char *const *skip, size_t skip_count, char *error,
                                       size_t error_size)
{
    try {
        std::vector<std::string> skip_actions(skip, skip + skip_count);
        cca::recordHistory(enabled != 0, stacks ? gather_stack : nullptr, max_entries,
                           stacks ? cca::RecordContext::ALL : cca::RecordContext::NEVER,
                           clear != 0, skip_actions);
    } catch (const std::exception &failure) {
        write_error(error, error_size, failure.what());
        return -1;
    }
    return 0;
}

// Test entries: torch's own dispatch (c10::cuda::CUDACachingAllocator's
// free functions call the current allocator), asked from Python by
// tests/torch_pool_cases.py where torch has no binding. 0, or -1 when torch
// threw (the text in `error`).
extern "C" __attribute__((visibility("default"))) int
matepoint_torch_adapter_cache_info(int device, size_t *largest, char *error, size_t error_size)
{
    try {
        cca::cacheInfo(static_cast<c10::DeviceIndex>(device), largest);
    } catch (const std::exception &failure) {
        write_error(error, error_size, failure.what());
        return -1;
    }
    return 0;
}

// torch 2.13+'s marks of a capture's begin and end (CUDAGraph's
// capture_begin after cudaStreamBeginCapture, capture_end after
// cudaStreamEndCapture), which torch exposes to no Python caller: the
// tests' captures of the simulated GPU mark themselves through this. -1
// with the reason in `error` on an older torch.
extern "C" __attribute__((visibility("default"))) int
matepoint_torch_adapter_mark_capture(int device, int begin, char *error, size_t error_size)
{
#if MATEPOINT_TORCH_AT_LEAST(2, 13)
    try {
        if (begin)
            cca::markCaptureBegin(static_cast<c10::DeviceIndex>(device));
        else
            cca::markCaptureEnd(static_cast<c10::DeviceIndex>(device));
    } catch (const std::exception &failure) {
        write_error(error, error_size, failure.what());
        return -1;
    }
    return 0;
#else
    (void)device;
    (void)begin;
    write_error(error, error_size, "torch before 2.13 marks no capture");
    return -1;
#endif
}

extern "C" __attribute__((visibility("default"))) int
matepoint_torch_adapter_base_allocation(void *ptr, void **base, size_t *size, char *error,
                                        size_t error_size)
{
    try {
        *base = cca::getBaseAllocation(ptr, size);
    } catch (const std::exception &failure) {
        write_error(error, error_size, failure.what());
        return -1;
    }
    return 0;
}

#endif
