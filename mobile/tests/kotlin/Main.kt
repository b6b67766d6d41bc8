// One device through the generated Kotlin bindings (JNA, as on Android):
// enroll -> task -> upload against the server named by the environment.
// mobile/tests/kotlin.rs compiles it with the generated dev/canopy/canopy.kt.
import dev.canopy.*

fun env(name: String): String =
    System.getenv(name)?.takeIf { it.isNotEmpty() } ?: error("$name is not set")

class Progress : ProgressListener {
    var calls = 0
    override fun onProgress(progress: TrainingProgress) {
        calls += 1
    }
}

fun config(storage: String, fingerprint: String) = ClientConfig(
    serverUrl = env("CANOPY_URL"),
    trust = TrustSetting.PinnedSha256(fingerprint),
    storageDir = storage,
    limits = Limits(maxMemoryMb = 512uL, maxThreads = 2u, maxDownloadBytes = null, timeLimitMs = null),
    backend = BackendPreference.CPU,
    checkpointEverySteps = 0u,
    deviceAuthority = env("CANOPY_AUTHORITY"),
)

fun main() {
    println("canopy ${version()}")
    // A Rust error arrives as a typed Kotlin exception with the Rust message.
    try {
        CanopyClient(config(env("CANOPY_STORAGE") + "-bad", "xyz"))
        error("a bad fingerprint was accepted")
    } catch (e: CanopyException.Trust) {
        check(e.message!!.startsWith("fingerprint `xyz` is not 64 hex digits")) { e.message!! }
    }

    val client = CanopyClient(config(env("CANOPY_STORAGE"), env("CANOPY_FINGERPRINT")))
    val enrolled = client.enroll(env("CANOPY_TOKEN"), DeviceInfo(os = "jvm-test", memoryMb = 1024uL, tags = mapOf()))
    println("enrolled as device ${enrolled.deviceId} with ${enrolled.backends}")
    check(enrolled.deviceKey.length == 64 && client.status().deviceKey == enrolled.deviceKey)
    // A certificate the pinned device authority did not make is refused
    // before it is sent, as the SDK's `Certificate` error.
    try {
        client.installCertificate("11".repeat(64))
        error("a forged certificate was installed")
    } catch (e: CanopyException.Certificate) {
        check(e.message!!.contains("device ${enrolled.deviceId}")) { e.message!! }
    }
    client.reportConditions(DeviceConditions(charging = true, unmeteredNetwork = true, idle = true, batteryPercent = 80u))

    var task: TaskInfo? = null
    for (i in 0 until 60) {
        task = client.checkForTask(2000uL)
        if (task != null) break
    }
    checkNotNull(task) { "no task came" }
    println("task: round ${task.roundId}, ${task.epochs} epoch(s)")

    val samples = 40
    val features = List(samples * 64) { i -> ((i * 7919) % 17).toFloat() / 17f }
    val labels = List(samples) { i -> (i % 10).toLong() }
    val progress = Progress()
    val outcome = client.runTask(
        TrainingData.Arrays(features = features, sampleShape = listOf(64u), labels = labels, classes = 10u),
        progress,
        CancelToken(),
    )
    println("uploaded ${outcome.uploadedBytes} bytes from ${outcome.numSamples} samples, loss ${outcome.trainLoss}")
    check(outcome.numSamples == samples.toULong()) { "samples ${outcome.numSamples}" }
    check(outcome.uploadedBytes > 0uL)
    check(progress.calls > 0) { "no progress was reported" }
    check(client.status().pendingTask == null)
    try {
        client.runTask(TrainingData.Arrays(features, listOf(64u), labels, 10u), null, null)
        error("run_task without a task succeeded")
    } catch (e: CanopyException.NoTask) {
        check(e.message!!.contains("check_for_task"))
    }
    client.close()
    println("ok")
}
