/* A stand-in libcudart for test_cudart_load.c: every entry point the loader
 * resolves, doing nothing, except that cudaGetDeviceCount reports
 * FAKE_VERSION so the test can tell which copy was picked. */
#include <stddef.h>

#define STUB(name) int name(void) { return 0; }

int
cudaGetDeviceCount(int *count)
{
    *count = FAKE_VERSION;
    return 0;
}

STUB(cudaGetDevice) STUB(cudaSetDevice) STUB(cudaHostAlloc) STUB(cudaFreeHost)
STUB(cudaStreamCreateWithFlags) STUB(cudaStreamDestroy) STUB(cudaStreamWaitEvent)
STUB(cudaStreamSynchronize) STUB(cudaEventCreateWithFlags) STUB(cudaEventDestroy)
STUB(cudaEventRecord) STUB(cudaEventQuery) STUB(cudaEventSynchronize) STUB(cudaMemcpyAsync)
STUB(cudaMalloc) STUB(cudaFree) STUB(cudaMemGetInfo) STUB(cudaDeviceSynchronize)
STUB(cudaGetLastError)

const char *
cudaGetErrorString(int status)
{
    (void)status;
    return "fake";
}
