/* nb_config_string (include/nabla/config.h): what the CPU can do, what
 * OpenBLAS and oneDNN run, and which of them each kind of product takes
 * (the rule's own words come from tensor/cpu/dnnl.c, next to the rule).
 * Note [BLAS that does not know the CPU] in tensor/cpu/cpuinfo.h. */
#include "nabla/config.h"

#include <cblas.h>
#include <stdio.h>

#include "nabla/nabla.h"
#include "tensor/cpu/cpuinfo.h"
#include "tensor/cpu/dnnl.h"
#include "tensor/cpu/sgemm.h"
#include "tensor/cpu/threads.h"

enum { CAP = 4096 };
static _Thread_local char text[CAP];

#define ADD(...) (len += (size_t)snprintf(text + (len < CAP ? len : CAP), len < CAP ? CAP - len : 0, __VA_ARGS__))

const char *nb_config_string(void) {
    size_t len = 0;
    const nb__cpu_features *f = nb__cpu_features_get();
    nb__isa isa = nb__cpu_isa();
    ADD("nabla: %d.%d.%d\n", NABLA_VERSION_MAJOR, NABLA_VERSION_MINOR, NABLA_VERSION_PATCH);
    ADD("cpu: %s (%s), isa %s%s%s\n", *f->brand ? f->brand : "unknown model",
        *f->vendor ? f->vendor : "no cpuid", nb__isa_name(isa), f->avx512_bf16 ? " avx512_bf16" : "",
        f->amx ? " amx" : "");
    const char *core = nb__blas_core();
    int core_isa = nb__blas_core_isa(core);
    int bt = openblas_get_num_threads();
    ADD("openblas: %s; core %s (%s kernels), %d thread%s\n", nb__blas_config(), core,
        core_isa < 0 ? "unknown" : nb__isa_name((nb__isa)core_isa), bt, bt == 1 ? "" : "s");
    int pool = nb_get_num_threads();
    ADD("pool: %d thread%s (%s)\n", pool, pool == 1 ? "" : "s", nb__threads_source());
    size_t room = len < CAP ? CAP - len : 0;
    len += nb__dnnl_describe(text + (len < CAP ? len : CAP), room);
    if (nb__sgemm_kernel_on())
        ADD("f32 attention: nabla causal kernel %s (heads on the pool's %d thread%s)\n",
            nb__sgemm_width() == 512 ? "avx512" : "avx2", pool, pool == 1 ? "" : "s");
    else
        ADD("f32 attention: openblas %s (one thread per head, heads on the pool)\n", core);
    if (nb__blas_generic())
        ADD("note: OpenBLAS runs its generic %s core on this %s CPU (it does not know the model): "
            "f32 products and convolutions go to oneDNN, which chooses its kernels by "
            "instruction set\n",
            core, nb__isa_name(isa));
    if (len >= CAP) text[CAP - 2] = '\n', text[CAP - 1] = 0;
    return text;
}
