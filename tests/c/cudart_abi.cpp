// csrc/cuda/cudart.h declares the CUDA runtime's entry points by hand, so
// the package builds without CUDA: this file holds every declaration and
// constant to the toolkit's own (cuda_runtime_api.h). It only compiles
// (make abi-check); a mismatch is a static_assert naming the entry point.
#include <cuda_runtime_api.h>

#include <type_traits>

extern "C" {
#include "cuda/cudart.h"
}

namespace {

// Arguments pass alike through the C calling convention: the same type,
// two data pointers (handles are opaque pointers), or integers and enums
// of one size.
template <class A, class B>
constexpr bool same_argument()
{
    constexpr bool integer_a = std::is_integral_v<A> || std::is_enum_v<A>;
    constexpr bool integer_b = std::is_integral_v<B> || std::is_enum_v<B>;
    return std::is_same_v<A, B> || (std::is_pointer_v<A> && std::is_pointer_v<B>) ||
           (integer_a && integer_b && sizeof(A) == sizeof(B));
}

template <class R1, class... A1, class R2, class... A2>
constexpr bool same_function(R1 (*)(A1...), R2 (*)(A2...))
{
    if constexpr (sizeof...(A1) != sizeof...(A2))
        return false;
    else
        return same_argument<R1, R2>() && (same_argument<A1, A2>() && ...);
}

}  // namespace

#define SAME(field, function)                                                        \
    static_assert(same_function(decltype(cudart::field){}, &function),              \
                  "cudart." #field " does not match " #function)

SAME(get_device_count, cudaGetDeviceCount);
SAME(get_device, cudaGetDevice);
SAME(set_device, cudaSetDevice);
SAME(host_alloc, cudaHostAlloc);
SAME(free_host, cudaFreeHost);
SAME(stream_create, cudaStreamCreateWithFlags);
SAME(stream_destroy, cudaStreamDestroy);
SAME(stream_wait_event, cudaStreamWaitEvent);
SAME(stream_synchronize, cudaStreamSynchronize);
SAME(event_create, cudaEventCreateWithFlags);
SAME(event_destroy, cudaEventDestroy);
SAME(event_record, cudaEventRecord);
SAME(event_query, cudaEventQuery);
SAME(event_synchronize, cudaEventSynchronize);
SAME(memcpy_async, cudaMemcpyAsync);
SAME(malloc, cudaMalloc);
SAME(free, cudaFree);
SAME(mem_get_info, cudaMemGetInfo);
SAME(device_synchronize, cudaDeviceSynchronize);
SAME(get_last_error, cudaGetLastError);
SAME(get_error_string, cudaGetErrorString);
SAME(stream_is_capturing, cudaStreamIsCapturing);
SAME(thread_exchange_stream_capture_mode, cudaThreadExchangeStreamCaptureMode);

// every entry point above, and no other, is in the table
#define EQUAL(ours, cuda) \
    static_assert(static_cast<long>(ours) == static_cast<long>(cuda), #ours " is not " #cuda)

// ... plus primary_context_active, matepoint's wrapper of a driver call
static_assert(sizeof(cudart) == 24 * sizeof(void *), "cudart has entries this file does not check");

EQUAL(CUDART_SUCCESS, cudaSuccess);
EQUAL(CUDART_ERROR_INVALID_VALUE, cudaErrorInvalidValue);
EQUAL(CUDART_ERROR_MEMORY_ALLOCATION, cudaErrorMemoryAllocation);
EQUAL(CUDART_ERROR_INVALID_DEVICE, cudaErrorInvalidDevice);
EQUAL(CUDART_ERROR_INVALID_HANDLE, cudaErrorInvalidResourceHandle);
EQUAL(CUDART_ERROR_NOT_READY, cudaErrorNotReady);
EQUAL(CUDART_ERROR_STREAM_CAPTURE_UNSUPPORTED, cudaErrorStreamCaptureUnsupported);
EQUAL(CUDART_ERROR_STREAM_CAPTURE_IMPLICIT, cudaErrorStreamCaptureImplicit);
EQUAL(CUDART_STREAM_CAPTURE_STATUS_NONE, cudaStreamCaptureStatusNone);
EQUAL(CUDART_STREAM_CAPTURE_MODE_RELAXED, cudaStreamCaptureModeRelaxed);
EQUAL(CUDART_MEMCPY_HOST_TO_DEVICE, cudaMemcpyHostToDevice);
EQUAL(CUDART_MEMCPY_DEVICE_TO_HOST, cudaMemcpyDeviceToHost);
EQUAL(CUDART_HOST_ALLOC_PORTABLE, cudaHostAllocPortable);
EQUAL(CUDART_EVENT_DISABLE_TIMING, cudaEventDisableTiming);
EQUAL(CUDART_STREAM_NON_BLOCKING, cudaStreamNonBlocking);
