/* The interface's version and struct sizes, compiled into both libraries: kernel_abi.py compares them with
 * its ctypes definitions before it binds any other symbol. */
#include <stdint.h>

#include "kvserve.h"

int kvserve_abi_version(void) { return KVSERVE_ABI_VERSION; }

int kvserve_struct_sizes(int64_t *sizes, int n)
{
    const int64_t all[] = {sizeof(struct qlinear), sizeof(struct mixer), sizeof(struct decoder_layer),
                           sizeof(struct decoder)};
    const int count = (int)(sizeof all / sizeof all[0]);
    for (int i = 0; i < n && i < count; i++)
        sizes[i] = all[i];
    return count;
}
