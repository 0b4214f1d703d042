// Fallback flag primitives for devices without stream memory operations.
//
// The cuda backend signals with cuStreamWriteValue32 and waits with
// cuStreamWaitValue32 (zero SMs). Where the driver refuses those, these
// one-thread kernels do the same job at the cost of one resident CTA while a
// wait spins. Comparison is cyclic, as CU_STREAM_WAIT_VALUE_GEQ's is.

extern "C" __global__ void tide_signal(int* addr, int value) {
    __threadfence_system();  // the lane's earlier writes before the flag
    *reinterpret_cast<volatile int*>(addr) = value;
    __threadfence_system();
}

extern "C" __global__ void tide_wait(const int* addr, int value) {
    while ((int)(*reinterpret_cast<const volatile int*>(addr) - value) < 0) {
        __nanosleep(200);
    }
    __threadfence_system();  // the flag before the lane's later reads
}
