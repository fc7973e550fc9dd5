/* libFuzzer target for the launch environment (distributed/env.c).
 *
 * The input is a list of variables: a byte naming one of the variables
 * nb_dist_env_read (or nb_dist_select_device) reads, then its value up to
 * a NUL byte. Every known variable is unset first, the listed ones are set,
 * and nb_dist_env_read must either refuse with a message naming itself or
 * give a consistent place in a run: 0 <= rank < world, 0 <= local rank <
 * local world <= world, ports in [0, 65535], strings terminated. Then
 * nb__dist_pick_gpu with a visible-GPU count from the input must give an
 * index among those GPUs, or refuse. */
/* smoke-instrument: distributed/env.c */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/internal.h"

static const char *const names[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
    "SLURM_TASKS_PER_NODE", "SLURM_JOB_ID", "SLURM_STEP_ID", "NABLA_RUN_ID", "TORCHELASTIC_RUN_ID",
    "PMIX_NAMESPACE", "NABLA_STORE_PORT", "TORCHELASTIC_USE_AGENT_STORE", "CUDA_VISIBLE_DEVICES"};
#define N_NAMES (int)(sizeof names / sizeof names[0])

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    for (int i = 0; i < N_NAMES; i++) unsetenv(names[i]);
    if (size < 1) return 0;
    int visible = data[0] & 7;
    size_t i = 1;
    char value[512];
    while (i < size) {
        const char *name = names[data[i++] % N_NAMES];
        size_t k = 0;
        while (i < size && data[i] && k < sizeof value - 1) value[k++] = (char)data[i++];
        i++; /* the NUL */
        value[k] = 0;
        setenv(name, value, 1);
    }
    nb_dist_env e;
    if (nb_dist_env_read(&e) != NB_OK) {
        if (strstr(nb_last_error(), "nb_dist_env_read: ") != nb_last_error()) abort();
        return 0;
    }
    if (e.world_size < 1 || e.rank < 0 || e.rank >= e.world_size) abort();
    if (e.local_rank < 0 || e.local_world_size < 1 || e.local_rank >= e.local_world_size ||
        e.local_world_size > e.world_size)
        abort();
    if (e.master_port < 0 || e.master_port > 65535 || e.store_port < 0 || e.store_port > 65535)
        abort();
    if (e.world_size > 1 && (e.master_port == 0 || e.store_port == 0)) abort();
    if (!memchr(e.master_addr, 0, sizeof e.master_addr) || !memchr(e.run_id, 0, sizeof e.run_id))
        abort();
    if (!e.source || !e.master_addr[0] || !e.run_id[0]) abort();
    int index = -1;
    if (nb__dist_pick_gpu(e.local_rank, visible, getenv("CUDA_VISIBLE_DEVICES"), &index) == NB_OK &&
        (index < 0 || index >= visible))
        abort();
    return 0;
}
