/* A stand-in for torch's libc10_cuda.so: linked against the libcudart it
 * ships (the fake .so.12), as torch's own library is against its runtime. */
extern int cudaGetDeviceCount(int *count);

int
fake_torch_device_count(void)
{
    int count = 0;
    cudaGetDeviceCount(&count);
    return count;
}
