//! Where a forward's time goes, part by part: named sections of the model code (norms,
//! projections, RoPE, attention, routing, expert GEMMs...) timed while a profile is on, and
//! summed per name. `hslake debug prefill --profile-parts` prints the table.
//!
//! On a GPU each section is a pair of timing events recorded on libtorch's stream around the
//! section's kernels: nothing waits for the device while the forward runs, so the sections cost
//! two event records each and the GPU stays as busy as without them; the events are read once,
//! at [`stop`]. On the CPU the operations run as they are called, and the wall time is the
//! section's. The profile belongs to the thread that started it (a rank's thread): other threads
//! and a thread without one record nothing, and [`time`] is then the bare call.
use std::cell::RefCell;
use std::time::Instant;

use tch::Device;

use crate::error::Result;
use crate::gpu::cuda::{self, Event};

/// One named section's sum over a profile.
#[derive(Debug, Clone, PartialEq)]
pub struct PartTime {
    /// The section's name, as the model code gives it.
    pub name: &'static str,
    /// How many times it ran.
    pub calls: u64,
    /// Seconds in it, summed over those times.
    pub secs: f64,
}

/// A section timed on a GPU, not yet read.
struct Pending {
    name: &'static str,
    start: Event,
    end: Event,
}

/// This thread's profile.
struct Profile {
    gpu: bool,
    /// Per name, in the order the names first ran (the forward's order).
    parts: Vec<PartTime>,
    pending: Vec<Pending>,
}

impl Profile {
    fn add(&mut self, name: &'static str, secs: f64) {
        match self.parts.iter_mut().find(|p| p.name == name) {
            Some(p) => {
                p.calls += 1;
                p.secs += secs;
            }
            None => self.parts.push(PartTime {
                name,
                calls: 1,
                secs,
            }),
        }
    }
}

thread_local! {
    static PROFILE: RefCell<Option<Profile>> = const { RefCell::new(None) };
}

/// Starts a profile on this thread for a forward on `device` (its GPU made current), dropping
/// any earlier one.
pub(crate) fn start(device: Device) -> Result<()> {
    if let Device::Cuda(d) = device {
        cuda::set_device(d)?;
    }
    PROFILE.with(|p| {
        *p.borrow_mut() = Some(Profile {
            gpu: device.is_cuda(),
            parts: vec![],
            pending: vec![],
        })
    });
    Ok(())
}

/// Ends this thread's profile and returns its sections in the order they first ran (empty if
/// none was started). On a GPU, waits for the last section's events.
pub(crate) fn stop() -> Result<Vec<PartTime>> {
    let Some(mut profile) = PROFILE.with(|p| p.borrow_mut().take()) else {
        return Ok(vec![]);
    };
    let pending = std::mem::take(&mut profile.pending);
    if let Some(last) = pending.last() {
        last.end.synchronize()?;
    }
    for p in pending {
        let ms = p.end.elapsed_ms(&p.start)?;
        profile.add(p.name, f64::from(ms) / 1e3);
    }
    Ok(profile.parts)
}

/// Adds `secs` measured elsewhere (the capture copies on their own stream) to section `name`.
pub(crate) fn add(name: &'static str, secs: f64) {
    PROFILE.with(|p| {
        if let Some(profile) = p.borrow_mut().as_mut() {
            profile.add(name, secs);
        }
    });
}

/// Runs `f` as section `name` of this thread's profile; without a profile, just runs it.
pub(crate) fn time<T>(name: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let gpu = match PROFILE.with(|p| p.borrow().as_ref().map(|p| p.gpu)) {
        None => return f(),
        Some(gpu) => gpu,
    };
    if !gpu {
        let t = Instant::now();
        let out = f()?;
        add(name, t.elapsed().as_secs_f64());
        return Ok(out);
    }
    let start = Event::timed()?;
    start.record_on_default()?;
    let out = f()?;
    let end = Event::timed()?;
    end.record_on_default()?;
    PROFILE.with(|p| {
        if let Some(profile) = p.borrow_mut().as_mut() {
            profile.pending.push(Pending { name, start, end });
        }
    });
    Ok(out)
}

/// The sections as a table: per section its milliseconds per iteration over `iters`, its calls
/// per iteration and its share of `total_secs` (the timed iterations' wall time), then the time
/// outside every section.
pub fn table(parts: &[PartTime], total_secs: f64, iters: usize) -> String {
    let iters = iters.max(1) as f64;
    let total = total_secs.max(1e-12);
    let mut out = format!(
        "{:<28} {:>12} {:>10} {:>7}\n",
        "section", "ms/iter", "calls/iter", "share"
    );
    let mut line = |name: &str, secs: f64, calls: Option<f64>| {
        let calls = calls.map_or(String::new(), |c| format!("{c:.0}"));
        out.push_str(&format!(
            "{name:<28} {:>12.3} {calls:>10} {:>6.1}%\n",
            1e3 * secs / iters,
            100.0 * secs / total
        ));
    };
    for p in parts {
        line(p.name, p.secs, Some(p.calls as f64 / iters));
    }
    let inside: f64 = parts.iter().map(|p| p.secs).sum();
    line("(outside the sections)", total_secs - inside, None);
    line("(total)", total_secs, None);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_on() -> bool {
        PROFILE.with(|p| p.borrow().is_some())
    }

    #[test]
    fn without_a_profile_a_section_is_the_bare_call_and_nothing_is_recorded() {
        assert!(!is_on());
        let v = time("norm", || Ok(7)).unwrap();
        assert_eq!(v, 7);
        add("capture copies", 1.0);
        assert_eq!(stop().unwrap(), vec![]);
    }

    #[test]
    fn cpu_sections_sum_per_name_in_first_run_order_and_errors_pass_through() {
        start(Device::Cpu).unwrap();
        for _ in 0..3 {
            time("attention", || Ok(())).unwrap();
            time("norm", || Ok(())).unwrap();
        }
        let err = time::<()>("rope", || {
            Err(crate::error::CaptureError::Pipeline("boom".into()))
        });
        assert!(err.is_err());
        add("capture copies", 0.5);
        let parts = stop().unwrap();
        let names: Vec<(&str, u64)> = parts.iter().map(|p| (p.name, p.calls)).collect();
        assert_eq!(
            names,
            [("attention", 3), ("norm", 3), ("capture copies", 1)]
        );
        assert!(!is_on());
        let t = table(&parts, 1.0, 2);
        assert!(t.contains("capture copies"), "{t}");
        assert!(t.contains("(outside the sections)"), "{t}");
        assert!(
            t.lines()
                .any(|l| l.starts_with("attention") && l.contains(" 2 ")),
            "{t}"
        );
    }
}
