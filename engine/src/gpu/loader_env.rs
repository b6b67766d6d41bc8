//! The Vulkan loader's environment, prepared by a binary before its first
//! thread starts.
//!
//! Mesa ships an implicit layer, `VK_LAYER_MESA_device_select`, with its
//! Vulkan drivers (so it is on most Linux machines that have a GPU, and on
//! every one with lavapipe). When an instance enables
//! `VK_KHR_wayland_surface`, which wgpu always does where the extension
//! exists, the layer connects to a Wayland display to learn which GPU
//! drives it. Without `XDG_RUNTIME_DIR` (containers, system services, CI,
//! `sudo`) libwayland then prints `error: XDG_RUNTIME_DIR is invalid or
//! not set in the environment.` to stderr, once per probe: an "error"
//! that is not one, on every `canopy` command that looks for a GPU.
//!
//! We rank adapters ourselves (`context::ranked_adapters`), so the layer
//! adds nothing to us. It has its own off switch, `NODEVICE_SELECT=1`,
//! which the loader reads from the process environment when an instance
//! is created. Setting an environment variable is only sound while no
//! other thread can read the environment, so this is done only when the
//! process provably has a single thread, and never over a choice the
//! user made (`NODEVICE_SELECT` or `MESA_VK_DEVICE_SELECT` already set)
//! or where the layer can work (`XDG_RUNTIME_DIR` set).

#![allow(unsafe_code)]

/// Turns Mesa's device-select layer off when it could only print noise.
/// Call it first thing in `main`; returns whether it changed anything.
/// A no-op off Linux and in a process that already has other threads.
pub fn quiet_device_select_layer() -> bool {
    if !cfg!(target_os = "linux") || !layer_would_complain() || !is_single_threaded() {
        return false;
    }
    // SAFETY: `set_var` is unsound only while another thread may read or
    // write the environment. `is_single_threaded` saw this thread as the
    // process's only one, and only this thread could start another, which
    // it does not do before this call returns.
    unsafe { std::env::set_var("NODEVICE_SELECT", "1") };
    true
}

fn layer_would_complain() -> bool {
    let unset = |name: &str| std::env::var_os(name).is_none();
    unset("XDG_RUNTIME_DIR") && unset("NODEVICE_SELECT") && unset("MESA_VK_DEVICE_SELECT")
}

/// Whether this process has exactly one thread, from `/proc/self/task`
/// (one entry per thread). Unknown counts as no.
fn is_single_threaded() -> bool {
    std::fs::read_dir("/proc/self/task").is_ok_and(|tasks| tasks.take(2).count() == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_process_is_never_single_threaded_so_the_environment_is_left_alone() {
        // The test harness runs tests on worker threads beside the main one.
        let _other =
            std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_millis(200)));
        assert!(!is_single_threaded());
        assert!(!quiet_device_select_layer());
    }
}
