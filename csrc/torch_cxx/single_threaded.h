// A unit built on a new glibc that must load on torch's oldest (2.28).
//
// libstdc++ from GCC 11 on reads glibc's __libc_single_threaded (glibc
// 2.32 and newer) to skip atomic reference counts in a process with one
// thread; a unit compiled where glibc has it then needs GLIBC_2.32 to load,
// which torch's own manylinux_2_28 libraries do not. This unit's own copy,
// hidden and always 0 ("other threads may run"), keeps every count atomic,
// as it must be inside torch anyway, and leaves no reference to glibc's.
// Include it once per unit, before anything else.
#ifndef MATEPOINT_TORCH_CXX_SINGLE_THREADED_H
#define MATEPOINT_TORCH_CXX_SINGLE_THREADED_H

#if __has_include(<sys/single_threaded.h>)
#include <sys/single_threaded.h>
extern "C" __attribute__((visibility("hidden"))) char __libc_single_threaded;
char __libc_single_threaded = 0;
#endif

#endif
