/*
 * A stand-in for the driver's libnvidia-ml.so.1 on machines without a GPU: the few NVML calls
 * meshtrain.trainer.recovery.gpu_probe makes, answering as the environment says.
 *   FAKE_NVML_DEVICES  GPUs the container sees (default 1)
 *   FAKE_NVML_LOST     comma-separated indices whose calls fail
 *   FAKE_NVML_CODE     the NVML return code they fail with (default 15, NVML_ERROR_GPU_IS_LOST)
 *   FAKE_NVML_AT       "handle": nvmlDeviceGetHandleByIndex_v2 fails already, as for a GPU
 *                      fallen off the bus; else only the queries on the handle do
 *   FAKE_NVML_HANG_S   seconds nvmlInitWithFlags sleeps first (a driver that does not answer)
 * Device i's UUID is GPU-00000000-0000-0000-0000-<i as 12 digits>.
 * Return codes and the handle-passing convention are NVML's (nvml.h); nothing else is modelled.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { SUCCESS = 0, INVALID_ARGUMENT = 2, GPU_IS_LOST = 15 };

static unsigned devices(void) {
    const char *count = getenv("FAKE_NVML_DEVICES");
    return count ? (unsigned)atoi(count) : 1u;
}

static int lost(unsigned index) {
    const char *listed = getenv("FAKE_NVML_LOST");
    char copy[256];
    if (!listed) return 0;
    snprintf(copy, sizeof copy, "%s", listed);
    for (char *item = strtok(copy, ","); item; item = strtok(NULL, ","))
        if ((unsigned)atoi(item) == index) return 1;
    return 0;
}

static int code(void) {
    const char *given = getenv("FAKE_NVML_CODE");
    return given ? atoi(given) : GPU_IS_LOST;
}

static int at_handle(void) {
    const char *at = getenv("FAKE_NVML_AT");
    return at && strcmp(at, "handle") == 0;
}

static unsigned index_of(void *device) { return (unsigned)((uintptr_t)device - 1); }

int nvmlInitWithFlags(unsigned flags) {
    const char *hang = getenv("FAKE_NVML_HANG_S");
    (void)flags;
    if (hang) sleep((unsigned)atoi(hang));
    return SUCCESS;
}

int nvmlShutdown(void) { return SUCCESS; }

int nvmlDeviceGetCount_v2(unsigned *count) {
    *count = devices();
    return SUCCESS;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned index, void **device) {
    if (index >= devices()) return INVALID_ARGUMENT;
    if (at_handle() && lost(index)) return code();
    *device = (void *)(uintptr_t)(index + 1);
    return SUCCESS;
}

int nvmlDeviceGetUUID(void *device, char *uuid, unsigned length) {
    if (lost(index_of(device))) return code();
    snprintf(uuid, length, "GPU-00000000-0000-0000-0000-%012u", index_of(device));
    return SUCCESS;
}

const char *nvmlErrorString(int result) {
    return result == GPU_IS_LOST ? "GPU is lost" : "Unknown Error";
}
