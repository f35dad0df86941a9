/* The loader picks the libcudart torch itself links (csrc/cuda/cudart.c),
 * even when another package loaded a newer one first: two runtimes in one
 * process would not share streams, events or contexts.
 *
 * Run with the fake libraries' folder as argv[1]: libcudart.so.13 (loaded
 * first, as another package would), libcudart.so.12 and libc10_cuda.so
 * linked to the .so.12 (torch). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "cuda/cudart.h"
#include "check.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

static void *
load(const char *folder, const char *name)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", folder, name);
    void *handle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (handle == NULL)
        fprintf(stderr, "%s\n", dlerror());
    return handle;
}

static int
ends_with(const char *text, const char *suffix)
{
    size_t n = strlen(text), m = strlen(suffix);
    return n >= m && strcmp(text + n - m, suffix) == 0;
}

int
main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s FOLDER\n", argv[0]);
        return 2;
    }
    CHECK(load(argv[1], "libcudart.so.13") != NULL);     /* another package's, first */
    CHECK(load(argv[1], "libc10_cuda.so") != NULL);      /* torch's, with its .so.12 */
    const cudart *rt = cudart_load();
    int count = 0;
    CHECK(rt != NULL);
    if (rt != NULL)
        CHECK(rt->get_device_count(&count) == 0 && count == 12);
    CHECK(ends_with(cudart_origin(), "libcudart.so.12"));
    if (!ends_with(cudart_origin(), "libcudart.so.12"))
        fprintf(stderr, "picked %s\n", cudart_origin());
    return check_report("test_cudart_load");
}
