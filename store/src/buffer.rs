//! Large zeroed byte buffers for decoded states, in memory that faults in cheaply; and the
//! allocator policy of processes that write shards ([`keep_freed_memory_for_reuse`]).
//!
//! The loader decodes hundreds of MB of states per batch into fresh buffers, and at EAGLE-3
//! sizes faulting in their 4 KiB pages took about a third of its CPU (perf, 2-core VM). So the
//! bytes come from `calloc`, which gets large blocks as already-zero pages from the kernel (no
//! memset), and large ones are marked for 2 MiB transparent huge pages before anything touches
//! them: one page fault where there were 512. Where the kernel gives no huge pages (THP off)
//! the advice changes nothing.

/// Makes glibc's `malloc` keep freed blocks of up to 32 MiB for reuse rather than hand them
/// back to the kernel. A shard writer allocates and frees buffers of 1–32 MiB for every sample
/// (encoded tensor values, Parquet pages); by default glibc serves blocks that large with a
/// fresh `mmap` and frees them with `munmap`, so every buffer's pages are faulted in and
/// zeroed again, and every `munmap` interrupts each thread of the process to flush its TLB —
/// with a dozen writer threads and the GPU's thread in one process. Measured on the write
/// path at DeepSeek width (one writer, 2-core VM, three alternations): the writer's page faults
/// −85 %, raw MB written per CPU second +8 % on average (noisy). The cost is memory: each
/// thread's arena stays at its peak. Call once, early; with another C library it does
/// nothing.
pub fn keep_freed_memory_for_reuse() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets allocator parameters, under glibc's own lock.
        let set = unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30) == 1
        };
        if !set {
            tracing::debug!("glibc refused the malloc thresholds; keeping its defaults");
        }
    }
}

/// Buffers from this size on are asked to be backed by transparent huge pages.
const HUGE_FROM: usize = 8 << 20;

/// A transparent huge page on x86-64 and aarch64 with 4 KiB base pages.
const HUGE_PAGE: usize = 2 << 20;

/// `n` zero bytes; from [`HUGE_FROM`] on, backed by huge pages where the kernel allows.
pub fn zeroed(n: usize) -> Vec<u8> {
    let bytes = vec![0u8; n];
    if n >= HUGE_FROM {
        advise_huge_pages(&bytes);
    }
    bytes
}

/// Asks the kernel to back the whole huge pages inside `bytes` with huge pages.
fn advise_huge_pages(bytes: &[u8]) {
    let first = bytes.as_ptr() as usize;
    let begin = first.next_multiple_of(HUGE_PAGE);
    let end = (first + bytes.len()) / HUGE_PAGE * HUGE_PAGE;
    if end > begin {
        // SAFETY: the range lies inside `bytes`, memory this process owns; MADV_HUGEPAGE only
        // changes how its pages are backed, never their contents. A refusal is harmless.
        unsafe {
            libc::madvise(begin as *mut libc::c_void, end - begin, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_and_small_buffers_are_zero_and_of_the_size_asked() {
        for n in [0, 1, 4096, HUGE_FROM + 12345] {
            let b = zeroed(n);
            assert_eq!(b.len(), n);
            assert!(b.iter().all(|&x| x == 0));
        }
    }
}
