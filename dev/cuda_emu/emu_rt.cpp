/* The emulator's runtime (dev/cuda_emu): emu_launch, and the pieces of
 * tensor/cuda/runtime.cu that the kernel files call. */
#include <thread>

#include <cublasLt.h>

#include "emu.h"
#include "tensor/backend.h"
#include "tensor/cuda/cuda.h"

thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
std::barrier<> *emu_block_bar;
std::vector<std::barrier<> *> emu_warp_bar;
unsigned char emu_xchg[32][32][16];
long emu_launches, emu_blocks;

void emu_launch(dim3 grid, dim3 block, size_t smem, std::function<void()> fn) {
    emu_launches++;
    unsigned n = block.x * block.y * block.z;
    /* the limits of the GPUs we run on: what cudaGetLastError would report */
    if (n == 0 || n > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535 || smem > 48 * 1024) {
        fprintf(stderr, "cuda_emu: bad launch: grid (%u, %u, %u) block (%u, %u, %u) smem %zu\n",
                grid.x, grid.y, grid.z, block.x, block.y, block.z, smem);
        abort();
    }
    gridDim = grid;
    blockDim = block;
    unsigned warps = (n + 31) / 32;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                emu_blocks++;
                std::barrier<> block_bar(n);
                std::vector<std::barrier<> *> warp_bar;
                for (unsigned w = 0; w < warps; w++)
                    warp_bar.push_back(new std::barrier<>(w + 1 < warps ? 32 : n - 32 * w));
                emu_block_bar = &block_bar;
                emu_warp_bar = warp_bar;
                std::vector<std::thread> threads;
                threads.reserve(n);
                for (unsigned t = 0; t < n; t++)
                    threads.emplace_back([&, t] {
                        threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
                        blockIdx = dim3(bx, by, bz);
                        fn();
                        warp_bar[t / 32]->arrive_and_drop(); /* an exited thread leaves the barriers */
                        block_bar.arrive_and_drop();
                    });
                for (auto &t : threads) t.join();
                for (auto *w : warp_bar) delete w;
            }
}

extern "C" {
static nb__cuda_fault emu_fault;
void nb__cuda_use(const char *, int) {}
nb__stream nb__cuda_compute_stream(int) { return nullptr; }
nb__cuda_fault *nb__cuda_fault_slot(int) { return &emu_fault; }
/* cuDNN cannot run here: attention.cu's own kernels are what is tested */
bool nb__cuda_cudnn_attention(nb_tensor *, nb_tensor *, const nb_tensor *, int, double, const char **why) {
    *why = "the emulator has no cuDNN";
    return false;
}
bool nb__cuda_cudnn_attention_backward(nb_tensor *, const nb_tensor *, const nb_tensor *, const nb_tensor *,
                                       const nb_tensor *, int, double, const char **why) {
    *why = "the emulator has no cuDNN";
    return false;
}

/* matmul.cu's handle, workspace and TF32 switch (include/cublasLt.h's
 * stand-in computes the products) */
void *nb__cuda_cublaslt(int) {
    static emu_lt_handle h;
    return &h;
}
void *nb__cuda_gemm_workspace(int, size_t *bytes) {
    static unsigned char ws[256];
    *bytes = sizeof ws;
    return ws;
}
bool nb__cuda_tf32(void) { return false; }

/* Scratch from the context comes filled with 0xff bytes (NaN in f32/f64/
 * bf16/f16, -1 in integers) unless zeroing was asked for, so that a kernel
 * reading scratch it never wrote shows up in the results (not the meta
 * device's, which is no memory: drv_profile counts on it). Linked with
 * -Wl,--wrap=nb_ctx_alloc. */
void *__real_nb_ctx_alloc(nb_ctx *c, size_t bytes, int zero);
void *__wrap_nb_ctx_alloc(nb_ctx *c, size_t bytes, int zero) {
    void *p = __real_nb_ctx_alloc(c, bytes, zero);
    if (p && !zero && !nb__backend_of(nb_ctx_device(c))->meta) memset(p, 0xff, bytes);
    return p;
}
}
