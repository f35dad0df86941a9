// The throw of torch.OutOfMemoryError. torch lets a pluggable allocator
// report that it is out of memory only by throwing c10::OutOfMemoryError
// from its malloc entry point (a NULL return is not checked and crashes
// later), and Python then receives torch.OutOfMemoryError. This file only
// throws it: the allocator (C) builds the message and calls
// matepoint_raise_oom after releasing every lock it held. It is built per
// torch against its headers and libc10 (prebuilt in the wheel, or compiled
// here: matepoint/_units.py), so the exception type is torch's.
#include "single_threaded.h"

#include <c10/util/Exception.h>

extern "C" __attribute__((visibility("default"))) void
matepoint_raise_oom(const char *message)
{
    TORCH_CHECK_WITH(OutOfMemoryError, false, message);
}
