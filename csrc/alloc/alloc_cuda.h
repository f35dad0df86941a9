/* CUDA runtime backend of the allocator (csrc/cuda/cudart.h loads the
 * runtime). Device calls switch to the block's device and back. Every
 * failure the allocator goes on from (a failed cudaMalloc, cudaErrorNotReady
 * from cudaEventQuery, a failed record, free or switch) is cleared from the
 * thread's last error, so torch's later error checks do not see it. The
 * calls a CUDA graph capture forbids run in relaxed capture mode, so a
 * capture of another stream survives them.
 * Thread-safety: stateless apart from the runtime table. */
#ifndef MATEPOINT_ALLOC_CUDA_H
#define MATEPOINT_ALLOC_CUDA_H

#include "alloc.h"

struct cudart;
alloc_backend alloc_cuda_backend(const struct cudart *rt);

/* The text of the last CUDA failure the backend reported on the calling
 * thread since alloc_cuda_forget_failure() ("" when none): why a request
 * got nothing when that was not out of memory (a sticky error of an
 * earlier kernel fails cudaMalloc too). */
const char *alloc_cuda_failure(void);
void alloc_cuda_forget_failure(void);

#endif
