/* What a run's memory came to: the process's peak resident set and one
 * line that sets a training step's peak beside the floor computed from the
 * model's shape (nb_gpt_memory_floor), so that a user sees how far from
 * the floor a configuration is and which batch fits a device. */
#include <stdio.h>
#include <string.h>

#include "nabla/models.h"
#include "nabla/monitor.h"

size_t nb_peak_rss(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    size_t kib = 0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "VmHWM:", 6) == 0) {
            unsigned long long v = 0;
            if (sscanf(line + 6, "%llu", &v) == 1) kib = (size_t)v;
            break;
        }
    fclose(f);
    return kib * 1024;
}

static double mib(size_t bytes) { return (double)bytes / 1048576.0; }

char *nb_memory_report(char *buf, size_t size, const nb_memory_floor *floor, const nb_ctx *step,
                       const nb_ctx *params) {
    size_t need = floor->saved + floor->logits, peak = nb_ctx_peak(step);
    char rss[64] = "";
    size_t hwm = nb_ctx_device(step).type == NB_DEVICE_CPU ? nb_peak_rss() : 0;
    if (hwm) snprintf(rss, sizeof rss, "; process peak RSS %.1f MiB", mib(hwm));
    snprintf(buf, size,
             "memory: step context peak %.1f MiB, %.2fx its floor of %.1f MiB (%.1f saved for "
             "backward + %.1f logits), %.1f MiB of blocks touched; model context %.1f MiB "
             "(floor: parameters %.1f + gradients %.1f), optimizer state %.1f MiB%s",
             mib(peak), need ? (double)peak / (double)need : 0.0, mib(need), mib(floor->saved),
             mib(floor->logits), mib(nb_ctx_extent(step)), mib(nb_ctx_peak(params)),
             mib(floor->params), mib(floor->grads), mib(floor->optim_state), rss);
    return buf;
}
