// matepoint's one C++ unit. torch lets a pluggable allocator report that
// it is out of memory only by throwing c10::OutOfMemoryError from its malloc
// entry point (a NULL return is not checked and crashes later), and Python
// then receives torch.OutOfMemoryError. This file only throws it: the
// allocator (C) builds the message and calls matepoint_raise_oom after
// releasing every lock it held. It is compiled against the running torch's
// headers and libc10 (matepoint/_oom.py), so the exception type is torch's.
#include <c10/util/Exception.h>

extern "C" __attribute__((visibility("default"))) void
matepoint_raise_oom(const char *message)
{
    TORCH_CHECK_WITH(OutOfMemoryError, false, message);
}
