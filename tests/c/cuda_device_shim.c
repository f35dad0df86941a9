/* Preloaded into the processes of tests/torch_mempool_cases.py and
 * tests/torch_parity_cases.py (a machine without a GPU): torch asks the
 * CUDA runtime for the current device (a MemPool when made, a CUDA tensor's
 * device guard), counts the devices first, and reads the stream priority
 * range once before it hands out its first stream, all of which fail
 * without a driver. These answer as the simulated GPU would: two devices,
 * a current device per thread (0 in a new thread), torch's default
 * priorities. Nothing else of the runtime is replaced: a call that would
 * run on the GPU still fails. */
#include <stddef.h>

enum { SHIM_DEVICES = 2, SHIM_SUCCESS = 0, SHIM_INVALID_DEVICE = 101 };

static __thread int current_device;

int cudaGetDevice(int *device);
int cudaSetDevice(int device);
int cudaGetDeviceCount(int *count);
int cudaDeviceGetStreamPriorityRange(int *least, int *greatest);

int
cudaGetDevice(int *device)
{
    *device = current_device;
    return SHIM_SUCCESS;
}

int
cudaSetDevice(int device)
{
    if (device < 0 || device >= SHIM_DEVICES)
        return SHIM_INVALID_DEVICE;
    current_device = device;
    return SHIM_SUCCESS;
}

int
cudaGetDeviceCount(int *count)
{
    *count = SHIM_DEVICES;
    return SHIM_SUCCESS;
}

int
cudaDeviceGetStreamPriorityRange(int *least, int *greatest)
{
    if (least != NULL)
        *least = 0;
    if (greatest != NULL)
        *greatest = -5;
    return SHIM_SUCCESS;
}
