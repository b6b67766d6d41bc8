/* One device through the C ABI: enroll -> task -> upload, against the
 * server named by the environment (CANOPY_URL, CANOPY_FINGERPRINT,
 * CANOPY_TOKEN, CANOPY_STORAGE). mobile/tests/c_abi.rs compiles it
 * against the generated canopy.h and runs it under valgrind.
 *
 * Exit status: 0 when the update was uploaded, 1 on any failure (the
 * library's error name and message are printed). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "canopy.h"

#define SAMPLES 40
#define FEATURES 64

static const char *env(const char *name) {
    const char *value = getenv(name);
    if (value == NULL || *value == '\0') {
        fprintf(stderr, "error: %s is not set\n", name);
        exit(1);
    }
    return value;
}

static int failed(const char *what, CanopyStatus status) {
    fprintf(stderr, "error: %s failed with status %d (%s): %s\n", what, (int)status,
            canopy_last_error_name(), canopy_last_error_message());
    return 1;
}

struct progress {
    uint64_t calls;
    uint64_t total;
};

static void on_progress(uint64_t done, uint64_t total, double mean_loss, void *user_data) {
    struct progress *seen = user_data;
    seen->calls++;
    seen->total = total;
    (void)done;
    (void)mean_loss;
}

static int check_errors_are_values(void) {
    /* NULL arguments and a bad fingerprint come back as errors with a
     * message, never a crash. */
    CanopyClient *client = NULL;
    CanopyStatus status = canopy_client_new(NULL, NULL, NULL, "/tmp", NULL, CANOPY_BACKEND_CPU, NULL, &client);
    if (status != CANOPY_INVALID_CONFIG || strstr(canopy_last_error_message(), "server_url") == NULL) {
        fprintf(stderr, "error: a NULL server_url gave %d: %s\n", (int)status, canopy_last_error_message());
        return 1;
    }
    status = canopy_client_new("https://127.0.0.1:9", "xyz", NULL, env("CANOPY_STORAGE"), NULL,
                               CANOPY_BACKEND_CPU, NULL, &client);
    if (status != CANOPY_INVALID_CONFIG || strcmp(canopy_last_error_name(), "Trust") != 0) {
        fprintf(stderr, "error: a bad fingerprint gave %d (%s)\n", (int)status, canopy_last_error_name());
        return 1;
    }
    status = canopy_client_new(env("CANOPY_URL"), env("CANOPY_FINGERPRINT"), NULL, env("CANOPY_STORAGE"), NULL,
                               CANOPY_BACKEND_CPU, "abc", &client);
    if (status != CANOPY_INVALID_CONFIG || strstr(canopy_last_error_message(), "device_authority") == NULL) {
        fprintf(stderr, "error: a bad device authority gave %d: %s\n", (int)status, canopy_last_error_message());
        return 1;
    }
    canopy_client_free(NULL);
    canopy_cancel_token_free(NULL);
    return 0;
}

int main(void) {
    printf("canopy %s\n", canopy_version());
    if (check_errors_are_values() != 0) {
        return 1;
    }
    CanopyLimits limits = {.max_memory_mb = 512, .max_threads = 1, .max_download_bytes = 0, .time_limit_ms = 0};
    CanopyClient *client = NULL;
    CanopyStatus status = canopy_client_new(env("CANOPY_URL"), env("CANOPY_FINGERPRINT"), NULL,
                                            env("CANOPY_STORAGE"), &limits, CANOPY_BACKEND_CPU,
                                            env("CANOPY_AUTHORITY"), &client);
    if (status != CANOPY_OK) {
        return failed("canopy_client_new", status);
    }
    int64_t device_id = 0;
    status = canopy_client_enroll(client, env("CANOPY_TOKEN"), "c-test", 1024, &device_id);
    if (status != CANOPY_OK) {
        canopy_client_free(client);
        return failed("canopy_client_enroll", status);
    }
    printf("enrolled as device %lld\n", (long long)device_id);
    /* A certificate the pinned authority did not make is refused before
     * it is sent, by the SDK's error name. */
    char forged[129];
    memset(forged, '1', 128);
    forged[128] = '\0';
    status = canopy_client_install_certificate(client, forged);
    if (status != CANOPY_VERIFICATION || strcmp(canopy_last_error_name(), "Certificate") != 0) {
        fprintf(stderr, "error: a forged certificate gave %d (%s)\n", (int)status, canopy_last_error_name());
        canopy_client_free(client);
        return 1;
    }
    CanopyConditions conditions = {.charging = true, .unmetered_network = true, .idle = true, .battery_percent = 80};
    if ((status = canopy_client_report_conditions(client, &conditions)) != CANOPY_OK) {
        canopy_client_free(client);
        return failed("canopy_client_report_conditions", status);
    }

    CanopyTaskInfo task;
    bool has_task = false;
    for (int i = 0; i < 60 && !has_task; i++) {
        if ((status = canopy_client_check_for_task(client, 2000, &task, &has_task)) != CANOPY_OK) {
            canopy_client_free(client);
            return failed("canopy_client_check_for_task", status);
        }
    }
    if (!has_task) {
        fprintf(stderr, "error: no task came\n");
        canopy_client_free(client);
        return 1;
    }
    printf("task: round %lld, %u epoch(s), batch %u\n", (long long)task.round_id, task.epochs, task.batch_size);

    float *features = malloc(sizeof(float) * SAMPLES * FEATURES);
    int64_t labels[SAMPLES];
    for (size_t i = 0; i < SAMPLES * FEATURES; i++) {
        features[i] = (float)((i * 7919) % 17) / 17.0f;
    }
    for (int64_t i = 0; i < SAMPLES; i++) {
        labels[i] = i % 10;
    }
    uint32_t shape[1] = {FEATURES};
    struct progress seen = {0, 0};
    CanopyCancelToken *cancel = canopy_cancel_token_new();
    CanopyTaskOutcome outcome;
    status = canopy_client_run_task(client, features, SAMPLES * FEATURES, shape, 1, labels, SAMPLES, 10,
                                    on_progress, &seen, cancel, &outcome);
    free(features);
    canopy_cancel_token_free(cancel);
    if (status != CANOPY_OK) {
        canopy_client_free(client);
        return failed("canopy_client_run_task", status);
    }
    printf("uploaded %llu bytes from %llu samples, loss %.4f, %llu progress calls of %llu steps\n",
           (unsigned long long)outcome.uploaded_bytes, (unsigned long long)outcome.num_samples,
           outcome.train_loss, (unsigned long long)seen.calls, (unsigned long long)seen.total);
    if (outcome.num_samples != SAMPLES || outcome.uploaded_bytes == 0 || !isfinite(outcome.train_loss) ||
        seen.calls == 0) {
        fprintf(stderr, "error: the outcome is not what was sent\n");
        canopy_client_free(client);
        return 1;
    }

    char *json = NULL;
    if ((status = canopy_client_status_json(client, &json)) != CANOPY_OK) {
        canopy_client_free(client);
        return failed("canopy_client_status_json", status);
    }
    printf("status: %s\n", json);
    canopy_string_free(json);

    /* run_task with nothing accepted is an error value. */
    status = canopy_client_run_task(client, NULL, 0, shape, 1, NULL, 0, 10, NULL, NULL, NULL, &outcome);
    if (status != CANOPY_NO_TASK) {
        fprintf(stderr, "error: run_task without a task gave %d\n", (int)status);
        canopy_client_free(client);
        return 1;
    }
    canopy_client_free(client);
    printf("ok\n");
    return 0;
}
