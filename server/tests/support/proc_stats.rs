//! A process's memory, read from `/proc`, for benches that measure a
//! server's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How often [`RssSampler`] reads `VmRSS`.
const RSS_SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// A `kB` field of `/proc/<pid>/status`, in bytes.
pub fn proc_status_bytes(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines().find_map(|line| {
        let kb = line
            .strip_prefix(field)?
            .strip_prefix(':')?
            .trim()
            .strip_suffix("kB")?;
        kb.trim().parse::<u64>().ok().map(|kb| kb * 1024)
    })
}

/// Samples a process's `VmRSS` on a thread; each phase reads and resets
/// its own peak.
pub struct RssSampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssSampler {
    pub fn start(pid: u32) -> RssSampler {
        let peak = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (peak, stop) = (peak.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(rss) = proc_status_bytes(pid, "VmRSS") {
                        peak.fetch_max(rss, Ordering::Relaxed);
                    }
                    std::thread::sleep(RSS_SAMPLE_EVERY);
                }
            })
        };
        RssSampler {
            peak,
            stop,
            thread: Some(thread),
        }
    }

    /// The highest sample since the last call.
    pub fn take_peak(&self, pid: u32) -> u64 {
        let now = proc_status_bytes(pid, "VmRSS").unwrap_or(0);
        self.peak.swap(now, Ordering::Relaxed).max(now)
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Resets a process's peak RSS (`VmHWM`) to its current RSS, so that the
/// next reading is the peak of what follows (Linux 4.0 and later).
pub fn reset_peak(pid: u32) -> std::io::Result<()> {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
}
