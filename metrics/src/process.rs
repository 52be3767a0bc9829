//! The job process's own resident memory, read from `/proc/self/status` each step.

/// The resident memory of this process at the end of a step, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessMemory {
    /// Resident now (`VmRSS`).
    pub resident_bytes: u64,
    /// The most that was resident since the process started (`VmHWM`).
    pub peak_resident_bytes: u64,
}

/// Reads this process's resident memory now and its peak since it started. `None`
/// where `/proc/self/status` cannot be read (not Linux).
///
/// The peak is not reset between steps: writing to `/proc/self/clear_refs` would
/// start a new one, but it also resets what `time -v` and other tools report as the
/// process's peak (`ru_maxrss`).
pub fn process_memory() -> Option<ProcessMemory> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_status(&status)
}

/// `VmRSS` and `VmHWM` out of a `/proc/PID/status` text, in bytes.
fn parse_status(status: &str) -> Option<ProcessMemory> {
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find_map(|l| l.strip_prefix(name))?;
        let kb = line.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
        kb.checked_mul(1024)
    };
    Some(ProcessMemory {
        resident_bytes: field("VmRSS:")?,
        peak_resident_bytes: field("VmHWM:")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernel_status_fields() {
        let status = "Name:\tyatt\nVmPeak:\t 9000 kB\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\n";
        assert_eq!(
            parse_status(status),
            Some(ProcessMemory {
                resident_bytes: 1024 * 1024,
                peak_resident_bytes: 2048 * 1024
            })
        );
        assert_eq!(parse_status("VmRSS:\t12 kB\n"), None, "no VmHWM");
        assert_eq!(parse_status("VmRSS:\tmany kB\nVmHWM:\t1 kB\n"), None);
    }

    #[test]
    fn the_peak_covers_what_was_touched_and_freed() {
        let Some(before) = process_memory() else {
            return; // not Linux: nothing to read
        };
        assert!(before.peak_resident_bytes >= before.resident_bytes);
        // Touch 64 MiB, then free it: the peak must include it from then on.
        let touched = vec![1u8; 64 << 20];
        std::hint::black_box(&touched);
        drop(touched);
        let after = process_memory().expect("read once, reads again");
        assert!(
            after.peak_resident_bytes >= before.resident_bytes + (60 << 20),
            "{before:?} then {after:?}"
        );
        // Reading does not reset it (what `time -v` reports stays whole).
        let again = process_memory().expect("reads again");
        assert!(again.peak_resident_bytes >= after.peak_resident_bytes);
    }
}
