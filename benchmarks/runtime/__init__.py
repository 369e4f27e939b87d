"""What the benchmarks run on besides the code they measure: the servers they start, the scratch
databases they create, and the kernel's block throttle that holds a disk to a slower medium's rate."""
