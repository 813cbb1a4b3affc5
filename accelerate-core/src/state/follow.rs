//! The worker's side of the launcher's lifeline: a worker that `accelerate-rs launch` started
//! ends when its launcher does (the launcher writes its pid for this, [`env_vars::LAUNCHER_PID`]).

use crate::env_vars;

/// Ties this process to the `accelerate-rs launch` that started it (when one did): the kernel
/// sends SIGKILL to this process when the launcher dies, even by SIGKILL, so no worker outlives
/// its job holding a device. Called once at start-up ([`ProcessState::from_env`]); a no-op
/// for processes other launchers started.
///
/// [`ProcessState::from_env`]: super::ProcessState::from_env
pub fn follow_launcher() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Some(launcher) = std::env::var(env_vars::LAUNCHER_PID)
            .ok()
            .and_then(|v| v.trim().parse::<i32>().ok())
            .filter(|&pid| pid > 1)
        else {
            return;
        };
        if nix::unistd::getppid().as_raw() != launcher {
            // A process a worker started (it inherited the variable): the launcher is alive
            // but not our parent, and this process is not ours to tie or end.
            let alive = !matches!(
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(launcher), None),
                Err(nix::errno::Errno::ESRCH)
            );
            if alive {
                return;
            }
            tracing::error!(
                launcher,
                "the accelerate launcher that started this worker is gone; exiting"
            );
            std::process::exit(1);
        }
        if let Err(e) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL) {
            tracing::warn!("cannot tie this worker to its launcher: {e}");
            return;
        }
        // The launcher may have died before the request above: then nobody will signal us,
        // and our parent is no longer the launcher.
        if nix::unistd::getppid().as_raw() != launcher {
            tracing::error!(
                launcher,
                "the accelerate launcher that started this worker is gone; exiting"
            );
            std::process::exit(1);
        }
    });
}
