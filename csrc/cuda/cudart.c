#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dlopen flags, posix_memalign */
#endif
#include "cudart.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

/* Written once under `load_once`, read-only afterwards. */
static cudart runtime;
static const cudart *loaded;
static char load_error[256];
static char origin[1024];                   /* the file the table came from */
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

/* torch's CUDA libraries: dlsym through one of them finds the libcudart
 * torch itself links, whatever else the process loaded */
static const char *const torch_libraries[] = {"libc10_cuda.so", "libtorch_cuda.so"};
static const char *const library_names[] = {
    "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so",
};
#define COUNT(array) (sizeof(array) / sizeof((array)[0]))

static int
resolve(void *handle, void **slot, const char *name)
{
    *slot = dlsym(handle, name);
    if (*slot == NULL)
        snprintf(load_error, sizeof(load_error), "libcudart lacks %s", name);
    return *slot != NULL;
}

/* The driver's entry points behind primary_context_active, resolved with
 * the runtime (under `load_once`), read-only afterwards. */
static int (*driver_device_get)(int *device, int ordinal);
static int (*driver_primary_state)(int device, unsigned *flags, int *active);

static int
driver_primary_context_active(int device, int *active)
{
    int handle;
    unsigned flags;
    if (driver_device_get(&handle, device) != 0)
        return CUDART_ERROR_INVALID_DEVICE;
    return driver_primary_state(handle, &flags, active) != 0 ? CUDART_ERROR_INVALID_VALUE
                                                            : CUDART_SUCCESS;
}

/* The driver a runtime runs over is loaded once the runtime is used;
 * without it (or its entry points) the question stays unanswered. */
static void
resolve_driver(void)
{
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (driver == NULL)
        return;
    *(void **)&driver_device_get = dlsym(driver, "cuDeviceGet");
    *(void **)&driver_primary_state = dlsym(driver, "cuDevicePrimaryCtxGetState");
    if (driver_device_get != NULL && driver_primary_state != NULL)
        runtime.primary_context_active = driver_primary_context_active;
}

/* Fills `runtime` from `handle`; 1 when every entry point was found. */
static int
resolve_all(void *handle)
{
    struct { void **slot; const char *name; } symbols[] = {
        {(void **)&runtime.get_device_count, "cudaGetDeviceCount"},
        {(void **)&runtime.get_device, "cudaGetDevice"},
        {(void **)&runtime.set_device, "cudaSetDevice"},
        {(void **)&runtime.host_alloc, "cudaHostAlloc"},
        {(void **)&runtime.free_host, "cudaFreeHost"},
        {(void **)&runtime.stream_create, "cudaStreamCreateWithFlags"},
        {(void **)&runtime.stream_destroy, "cudaStreamDestroy"},
        {(void **)&runtime.stream_wait_event, "cudaStreamWaitEvent"},
        {(void **)&runtime.stream_synchronize, "cudaStreamSynchronize"},
        {(void **)&runtime.event_create, "cudaEventCreateWithFlags"},
        {(void **)&runtime.event_destroy, "cudaEventDestroy"},
        {(void **)&runtime.event_record, "cudaEventRecord"},
        {(void **)&runtime.event_query, "cudaEventQuery"},
        {(void **)&runtime.event_synchronize, "cudaEventSynchronize"},
        {(void **)&runtime.memcpy_async, "cudaMemcpyAsync"},
        {(void **)&runtime.get_error_string, "cudaGetErrorString"},
        {(void **)&runtime.malloc, "cudaMalloc"},
        {(void **)&runtime.free, "cudaFree"},
        {(void **)&runtime.mem_get_info, "cudaMemGetInfo"},
        {(void **)&runtime.device_synchronize, "cudaDeviceSynchronize"},
        {(void **)&runtime.get_last_error, "cudaGetLastError"},
    };
    for (size_t i = 0; i < COUNT(symbols); i++) {
        if (!resolve(handle, symbols[i].slot, symbols[i].name))
            return 0;
    }
    /* optional: every CUDA since 10 has it, a stand-in library may not */
    *(void **)&runtime.stream_is_capturing = dlsym(handle, "cudaStreamIsCapturing");
    *(void **)&runtime.thread_exchange_stream_capture_mode =
        dlsym(handle, "cudaThreadExchangeStreamCaptureMode");
    resolve_driver();
    Dl_info info;
    if (dladdr((void *)runtime.get_device, &info) != 0 && info.dli_fname != NULL)
        snprintf(origin, sizeof(origin), "%s", info.dli_fname);
    return 1;
}

/* Tries `names` in turn (only those already loaded when `flags` has
 * RTLD_NOLOAD); 1 once one provides the whole runtime. */
static int
load_from(const char *const *names, size_t n, int flags)
{
    for (size_t i = 0; i < n; i++) {
        void *handle = dlopen(names[i], flags);
        if (handle == NULL)
            continue;
        if (resolve_all(handle))
            return 1;
        dlclose(handle);
    }
    return 0;
}

static void
load(void)
{
    snprintf(load_error, sizeof(load_error), "no CUDA runtime library (libcudart) found");
    if (load_from(torch_libraries, COUNT(torch_libraries), RTLD_NOW | RTLD_NOLOAD) ||
        load_from(library_names, COUNT(library_names), RTLD_NOW | RTLD_NOLOAD) ||
        load_from(library_names, COUNT(library_names), RTLD_NOW | RTLD_LOCAL))
        loaded = &runtime;
}

const cudart *
cudart_load(void)
{
    pthread_once(&load_once, load);
    return loaded;
}

const char *
cudart_error(void)
{
    pthread_once(&load_once, load);
    return loaded ? "" : load_error;
}

const char *
cudart_origin(void)
{
    pthread_once(&load_once, load);
    return origin;
}
