/* The fused copy-and-hash routine built with AVX2 (see copyhash.c): the hash of each chunk runs
 * on 256-bit vectors. Loaded only where the CPU reports avx2. */
#include "copyhash.c"
