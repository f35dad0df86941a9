/* Preloaded into the process of tests/torch_mempool_cases.py (a machine
 * without a GPU): torch.cuda.MemPool asks the CUDA runtime for the current
 * device when it is made (c10::cuda::current_device, whose error check
 * counts the devices first), which fails without a driver. These answer
 * as the simulated GPU would: device 0 current (the cases use it), two
 * devices. Nothing else of the runtime is replaced. */
int cudaGetDevice(int *device);

int
cudaGetDevice(int *device)
{
    *device = 0;
    return 0;   /* cudaSuccess */
}

int cudaGetDeviceCount(int *count);

int
cudaGetDeviceCount(int *count)
{
    *count = 2;
    return 0;
}
