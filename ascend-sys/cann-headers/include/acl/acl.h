/*
 * ascend-pd: our own declarations of the subset of the CANN ACL runtime
 * (libascendcl.so) that ascend-pd calls. Written from the public ACL
 * runtime API reference; names, values and signatures follow CANN so the
 * generated bindings load a real libascendcl.so unchanged. The files under
 * ascend-sys/cann-headers sit where a CANN 8.5 install has them, so the
 * generator reads this tree and a real install the same way.
 */
#ifndef ASCEND_PD_ACL_H
#define ASCEND_PD_ACL_H

#include <stddef.h>
#include <stdint.h>

#include "error_codes/rt_error_codes.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every ACL call returns an aclError; 0 is success. */
typedef int aclError;

/* Opaque runtime handles. */
typedef void *aclrtStream;
typedef void *aclrtEvent;

/* Generic status codes used by ascend-pd (values as published by CANN;
 * the runtime's ACL_ERROR_RT_* are in error_codes/rt_error_codes.h). */
static const int ACL_SUCCESS = 0;
static const int ACL_ERROR_INVALID_PARAM = 100000;
static const int ACL_ERROR_UNINITIALIZE = 100001;
static const int ACL_ERROR_REPEAT_INITIALIZE = 100002;
static const int ACL_ERROR_INVALID_FILE = 100003;
static const int ACL_ERROR_REPEAT_FINALIZE = 100037;
static const int ACL_ERROR_BAD_ALLOC = 200000;

/* Direction of a copy. */
typedef enum aclrtMemcpyKind {
    ACL_MEMCPY_HOST_TO_HOST = 0,
    ACL_MEMCPY_HOST_TO_DEVICE = 1,
    ACL_MEMCPY_DEVICE_TO_HOST = 2,
    ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
} aclrtMemcpyKind;

/* Page policy for device allocations. */
typedef enum aclrtMemMallocPolicy {
    ACL_MEM_MALLOC_HUGE_FIRST = 0,
    ACL_MEM_MALLOC_HUGE_ONLY = 1,
    ACL_MEM_MALLOC_NORMAL_ONLY = 2,
    ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3,
    ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4,
    ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5,
} aclrtMemMallocPolicy;

/* Answer of aclrtQueryEventStatus. */
typedef enum aclrtEventRecordedStatus {
    ACL_EVENT_RECORDED_STATUS_NOT_READY = 0,
    ACL_EVENT_RECORDED_STATUS_COMPLETE = 1,
} aclrtEventRecordedStatus;

/* Which memory aclrtGetMemInfo reports on. */
typedef enum aclrtMemAttr {
    ACL_DDR_MEM = 0,
    ACL_HBM_MEM = 1,
    ACL_DDR_MEM_HUGE = 2,
    ACL_DDR_MEM_NORMAL = 3,
    ACL_HBM_MEM_HUGE = 4,
    ACL_HBM_MEM_NORMAL = 5,
    ACL_DDR_MEM_P2P_HUGE = 6,
    ACL_DDR_MEM_P2P_NORMAL = 7,
    ACL_HBM_MEM_P2P_HUGE = 8,
    ACL_HBM_MEM_P2P_NORMAL = 9,
} aclrtMemAttr;

/* Process-wide setup and teardown; configPath may be NULL. */
aclError aclInit(const char *configPath);
aclError aclFinalize(void);

/* Devices: binding a device to the calling thread and releasing it. */
aclError aclrtSetDevice(int32_t deviceId);
aclError aclrtResetDevice(int32_t deviceId);
aclError aclrtGetDeviceCount(uint32_t *count);

/* Optional (not required at load): the SoC name (e.g. "Ascend910B3"; NULL
 * on failure; needs no aclInit), and the free and total bytes of the
 * current device's memory of one kind. */
const char *aclrtGetSocName(void);
aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total);

/* Device and pinned host memory. */
aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void *devPtr);
aclError aclrtMallocHost(void **hostPtr, size_t size);
aclError aclrtFreeHost(void *hostPtr);

/* Copies: destMax is the capacity behind dst, count the bytes to copy. */
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                     aclrtMemcpyKind kind);
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                          aclrtMemcpyKind kind, aclrtStream stream);
aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count);

/* Streams. */
aclError aclrtCreateStream(aclrtStream *stream);
aclError aclrtDestroyStream(aclrtStream stream);
aclError aclrtSynchronizeStream(aclrtStream stream);

/* Events. */
aclError aclrtCreateEvent(aclrtEvent *event);
aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream);
aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status);
aclError aclrtSynchronizeEvent(aclrtEvent event);
aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event);
aclError aclrtDestroyEvent(aclrtEvent event);

/* Text of the most recent failure on the calling thread (may be NULL). */
const char *aclGetRecentErrMsg(void);

#ifdef __cplusplus
}
#endif

#endif /* ASCEND_PD_ACL_H */
