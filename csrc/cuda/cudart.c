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
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

static const char *const library_names[] = {
    "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so",
};

static void *
open_runtime(void)
{
    size_t n = sizeof(library_names) / sizeof(library_names[0]);
    /* torch's own copy first, so there is a single runtime in the process */
    for (size_t i = 0; i < n; i++) {
        void *handle = dlopen(library_names[i], RTLD_NOW | RTLD_NOLOAD);
        if (handle != NULL)
            return handle;
    }
    for (size_t i = 0; i < n; i++) {
        void *handle = dlopen(library_names[i], RTLD_NOW | RTLD_LOCAL);
        if (handle != NULL)
            return handle;
    }
    return NULL;
}

static int
resolve(void *handle, void **slot, const char *name)
{
    *slot = dlsym(handle, name);
    if (*slot == NULL)
        snprintf(load_error, sizeof(load_error), "libcudart lacks %s", name);
    return *slot != NULL;
}

static void
load(void)
{
    void *handle = open_runtime();
    if (handle == NULL) {
        snprintf(load_error, sizeof(load_error), "no CUDA runtime library (libcudart) found");
        return;
    }
    struct { void **slot; const char *name; } symbols[] = {
        {(void **)&runtime.get_device_count, "cudaGetDeviceCount"},
        {(void **)&runtime.get_device, "cudaGetDevice"},
        {(void **)&runtime.set_device, "cudaSetDevice"},
        {(void **)&runtime.host_alloc, "cudaHostAlloc"},
        {(void **)&runtime.free_host, "cudaFreeHost"},
        {(void **)&runtime.stream_create, "cudaStreamCreateWithFlags"},
        {(void **)&runtime.stream_destroy, "cudaStreamDestroy"},
        {(void **)&runtime.stream_wait_event, "cudaStreamWaitEvent"},
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
    for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
        if (!resolve(handle, symbols[i].slot, symbols[i].name))
            return;
    }
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
