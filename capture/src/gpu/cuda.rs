//! The few CUDA runtime calls libtorch's C API does not expose to Rust: a side stream and
//! events, so device-to-host copies of captured states run beside the next forward instead
//! of after it. Linked against `libcudart.so.13` from the nvidia wheel that torch itself loads.
use std::ffi::{c_char, c_int, c_void, CStr};

use tch::Tensor;

use crate::error::{CaptureError, Result};

type CudaStream = *mut c_void;
type CudaEvent = *mut c_void;

const STREAM_NON_BLOCKING: u32 = 1;
const EVENT_DEFAULT: u32 = 0;
const EVENT_DISABLE_TIMING: u32 = 2;
const MEMCPY_HOST_TO_DEVICE: c_int = 1;
const MEMCPY_DEVICE_TO_HOST: c_int = 2;
/// `cudaHostRegisterPortable`: page-locked for every device of the process, not only the current.
const HOST_REGISTER_PORTABLE: u32 = 1;
/// `cudaHostRegisterReadOnly`: the device only reads the range (a read-only file mapping).
const HOST_REGISTER_READ_ONLY: u32 = 8;

extern "C" {
    fn cudaSetDevice(device: c_int) -> c_int;
    fn cudaGetDevice(device: *mut c_int) -> c_int;
    fn cudaDeviceSynchronize() -> c_int;
    fn cudaStreamCreateWithFlags(stream: *mut CudaStream, flags: u32) -> c_int;
    fn cudaStreamDestroy(stream: CudaStream) -> c_int;
    fn cudaEventCreateWithFlags(event: *mut CudaEvent, flags: u32) -> c_int;
    fn cudaEventDestroy(event: CudaEvent) -> c_int;
    fn cudaEventRecord(event: CudaEvent, stream: CudaStream) -> c_int;
    fn cudaEventSynchronize(event: CudaEvent) -> c_int;
    fn cudaEventElapsedTime(ms: *mut f32, start: CudaEvent, end: CudaEvent) -> c_int;
    fn cudaStreamWaitEvent(stream: CudaStream, event: CudaEvent, flags: u32) -> c_int;
    fn cudaMemcpyAsync(
        dst: *mut c_void,
        src: *const c_void,
        count: usize,
        kind: c_int,
        stream: CudaStream,
    ) -> c_int;
    fn cudaGetErrorString(error: c_int) -> *const c_char;
    fn cudaMemGetInfo(free: *mut usize, total: *mut usize) -> c_int;
    fn cudaHostRegister(ptr: *mut c_void, size: usize, flags: u32) -> c_int;
    fn cudaHostUnregister(ptr: *mut c_void) -> c_int;
    fn cudaDeviceGetAttribute(value: *mut c_int, attr: c_int, device: c_int) -> c_int;
    fn cudaLibraryLoadData(
        library: *mut *mut c_void,
        code: *const c_void,
        jit_options: *mut c_int,
        jit_values: *mut *mut c_void,
        jit_count: u32,
        library_options: *mut c_int,
        library_values: *mut *mut c_void,
        library_count: u32,
    ) -> c_int;
    fn cudaLibraryGetKernel(
        kernel: *mut *mut c_void,
        library: *mut c_void,
        name: *const c_char,
    ) -> c_int;
    fn cudaLaunchKernel(
        func: *const c_void,
        grid: Dim3,
        block: Dim3,
        args: *mut *mut c_void,
        shared_mem: usize,
        stream: CudaStream,
    ) -> c_int;
}

/// CUDA's `dim3`, passed by value to `cudaLaunchKernel`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Dim3 {
    x: u32,
    y: u32,
    z: u32,
}

/// `cudaErrorMemoryAllocation`: device memory, or page-locked host memory, ran out.
const CUDA_ERROR_MEMORY_ALLOCATION: c_int = 2;
const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;
const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;

fn check(code: c_int, what: &str) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: cudaGetErrorString returns a static, NUL-terminated string for any code.
    let msg = unsafe { CStr::from_ptr(cudaGetErrorString(code)) }
        .to_string_lossy()
        .into_owned();
    let message = format!("{what}: {msg} (error {code})");
    Err(match code {
        CUDA_ERROR_MEMORY_ALLOCATION => CaptureError::OutOfMemory { message },
        _ => CaptureError::Cuda(message),
    })
}

/// Makes `device` current for the calling thread (NCCL and raw copies use the current device).
pub fn set_device(device: usize) -> Result<()> {
    // SAFETY: plain FFI call with a value argument.
    check(unsafe { cudaSetDevice(device as c_int) }, "cudaSetDevice")
}

/// Waits until every stream of GPU `device` has run what was queued on it (libtorch's
/// `cuda::synchronize`, which panics in tch where this returns the error: a kernel's fault
/// that surfaced meanwhile, say). The calling thread's current device is left as it was.
pub fn synchronize(device: usize) -> Result<()> {
    let mut current: c_int = 0;
    // SAFETY: plain FFI calls; `current` outlives the call that writes it.
    check(unsafe { cudaGetDevice(&mut current) }, "cudaGetDevice")?;
    set_device(device)?;
    let done = check(unsafe { cudaDeviceSynchronize() }, "cudaDeviceSynchronize");
    check(unsafe { cudaSetDevice(current) }, "cudaSetDevice")?;
    done
}

/// Bytes free on GPU `device`, as the driver reports them (memory other processes hold is not
/// free). Makes `device` current on the calling thread.
pub fn free_memory(device: usize) -> Result<u64> {
    set_device(device)?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both are valid out-pointers.
    check(
        unsafe { cudaMemGetInfo(&mut free, &mut total) },
        "cudaMemGetInfo",
    )?;
    Ok(free as u64)
}

fn attribute(device: usize, attr: c_int, what: &str) -> Result<i32> {
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer; the attribute code is one of the runtime's.
    check(
        unsafe { cudaDeviceGetAttribute(&mut v, attr, device as c_int) },
        what,
    )?;
    Ok(v)
}

/// GPU `device`'s compute capability, e.g. `(9, 0)` for an H100/H200.
pub fn compute_capability(device: usize) -> Result<(i32, i32)> {
    let what = "cudaDeviceGetAttribute(compute capability)";
    Ok((
        attribute(device, ATTR_COMPUTE_CAPABILITY_MAJOR, what)?,
        attribute(device, ATTR_COMPUTE_CAPABILITY_MINOR, what)?,
    ))
}

/// How many streaming multiprocessors GPU `device` has.
pub fn multiprocessors(device: usize) -> Result<u32> {
    Ok(attribute(
        device,
        ATTR_MULTIPROCESSOR_COUNT,
        "cudaDeviceGetAttribute(SM count)",
    )? as u32)
}

/// Kernels compiled from PTX, loaded with the runtime's context-independent loading: one
/// handle serves every GPU of the process (each loads the code when it first runs a kernel),
/// and lives as long as the process.
pub struct Library(*mut c_void);

// SAFETY: a cudaLibrary_t is not tied to a thread or context; the runtime synchronises its use.
unsafe impl Send for Library {}
// SAFETY: as above; loading kernels from it and launching them are thread-safe runtime calls.
unsafe impl Sync for Library {}

impl Library {
    /// Loads NUL-terminated PTX text.
    pub fn load(ptx: &CStr) -> Result<Self> {
        let mut lib = std::ptr::null_mut();
        // SAFETY: `ptx` is NUL-terminated and outlives the call; no options are passed.
        check(
            unsafe {
                cudaLibraryLoadData(
                    &mut lib,
                    ptx.as_ptr().cast(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                )
            },
            "cudaLibraryLoadData",
        )?;
        Ok(Library(lib))
    }

    /// The `extern "C"` kernel `name`.
    pub fn kernel(&self, name: &CStr) -> Result<Kernel> {
        let mut k = std::ptr::null_mut();
        // SAFETY: `k` is a valid out-pointer, `self.0` a loaded library, `name` NUL-terminated.
        check(
            unsafe { cudaLibraryGetKernel(&mut k, self.0, name.as_ptr()) },
            "cudaLibraryGetKernel",
        )?;
        Ok(Kernel(k))
    }
}

/// One kernel of a [`Library`].
pub struct Kernel(*mut c_void);

// SAFETY: a cudaKernel_t is context-independent and may be launched from any thread.
unsafe impl Send for Kernel {}
// SAFETY: as above.
unsafe impl Sync for Kernel {}

impl Kernel {
    /// Queues the kernel on GPU `device` on the legacy default stream, which libtorch computes
    /// on, so it runs after the work that produced its inputs and before the work that reads its
    /// outputs.
    ///
    /// # Safety
    /// `args` must point at values of exactly the kernel's parameter types, in order, and every
    /// device pointer among them must stay valid until the stream has run the kernel (tensors
    /// the caching allocator only reuses for later work on this same stream are).
    pub unsafe fn launch(
        &self,
        device: usize,
        blocks: u32,
        threads: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        set_device(device)?;
        let dim = |x| Dim3 { x, y: 1, z: 1 };
        check(
            cudaLaunchKernel(
                self.0.cast_const(),
                dim(blocks),
                dim(threads),
                args.as_mut_ptr(),
                0,
                std::ptr::null_mut(),
            ),
            "cudaLaunchKernel",
        )
    }
}

/// A CUDA event; owned by one thread (raw pointers keep it `!Send`).
pub struct Event(CudaEvent);

impl Event {
    /// An event used only for ordering (no timestamp: cheaper to record).
    pub fn new() -> Result<Self> {
        Event::with_flags(EVENT_DISABLE_TIMING)
    }

    /// An event that records a timestamp, for [`Event::elapsed_ms`].
    pub fn timed() -> Result<Self> {
        Event::with_flags(EVENT_DEFAULT)
    }

    fn with_flags(flags: u32) -> Result<Self> {
        let mut e = std::ptr::null_mut();
        // SAFETY: `e` is a valid out-pointer.
        check(
            unsafe { cudaEventCreateWithFlags(&mut e, flags) },
            "cudaEventCreate",
        )?;
        Ok(Event(e))
    }

    /// Records the event after all work queued so far on libtorch's (legacy default) stream.
    pub fn record_on_default(&self) -> Result<()> {
        // SAFETY: the event is live; the null stream is the legacy default stream.
        check(
            unsafe { cudaEventRecord(self.0, std::ptr::null_mut()) },
            "cudaEventRecord",
        )
    }

    /// Makes libtorch's stream wait for this event before any work queued on it later.
    pub fn wait_on_default(&self) -> Result<()> {
        // SAFETY: both handles are live; the null stream is the legacy default stream.
        check(
            unsafe { cudaStreamWaitEvent(std::ptr::null_mut(), self.0, 0) },
            "cudaStreamWaitEvent",
        )
    }

    /// Blocks this thread until the work before the event's last record has completed.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live; synchronising only blocks this thread.
        check(
            unsafe { cudaEventSynchronize(self.0) },
            "cudaEventSynchronize",
        )
    }

    /// Milliseconds from `start` to `self`, both [`Event::timed`] and both completed.
    pub fn elapsed_ms(&self, start: &Event) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: `ms` is a valid out-pointer; both events are live.
        check(
            unsafe { cudaEventElapsedTime(&mut ms, start.0, self.0) },
            "cudaEventElapsedTime",
        )?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event was created by cudaEventCreateWithFlags and is destroyed once.
        unsafe { cudaEventDestroy(self.0) };
    }
}

/// A non-blocking side stream on one device for copies between host and device memory.
pub struct CopyStream {
    stream: CudaStream,
}

impl CopyStream {
    /// Creates the stream on `device` (made current for this thread).
    pub fn new(device: usize) -> Result<Self> {
        set_device(device)?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: `stream` is a valid out-pointer. Non-blocking: the stream must not serialise
        // with the legacy default stream libtorch computes on, or the copy would not overlap.
        check(
            unsafe { cudaStreamCreateWithFlags(&mut stream, STREAM_NON_BLOCKING) },
            "cudaStreamCreate",
        )?;
        Ok(CopyStream { stream })
    }

    /// Makes the stream wait for `event` before any copy queued on it later.
    pub fn wait_for(&self, event: &Event) -> Result<()> {
        // SAFETY: both handles are live.
        check(
            unsafe { cudaStreamWaitEvent(self.stream, event.0, 0) },
            "cudaStreamWaitEvent",
        )
    }

    /// Records `event` after every copy queued on the stream so far.
    pub fn record(&self, event: &Event) -> Result<()> {
        // SAFETY: both handles are live.
        check(
            unsafe { cudaEventRecord(event.0, self.stream) },
            "cudaEventRecord",
        )
    }

    /// Queues a copy of `src` to `len` bytes of device memory at `dst`.
    ///
    /// # Safety
    /// `dst` must be device memory of at least `src.len()` bytes that nothing else writes
    /// or reads until the copy is done (an event recorded after it has completed), and `src`
    /// must stay mapped and unchanged until then. From page-locked `src` the copy returns at
    /// once; from pageable memory the driver stages it and returns once `src` may be reused.
    pub unsafe fn upload(&self, dst: *mut c_void, src: &[u8]) -> Result<()> {
        check(
            cudaMemcpyAsync(
                dst,
                src.as_ptr().cast(),
                src.len(),
                MEMCPY_HOST_TO_DEVICE,
                self.stream,
            ),
            "cudaMemcpyAsync (host to device)",
        )
    }

    /// Starts copying each CUDA tensor into the matching pinned buffer once all work queued so
    /// far on libtorch's (default) stream is done; returns at once.
    pub fn start(&self, tensors: Vec<Tensor>, buffers: &[PinnedBuffer]) -> Result<PendingCopy> {
        if buffers.len() != tensors.len() {
            return Err(CaptureError::Cuda(format!(
                "{} tensors to copy but {} host buffers",
                tensors.len(),
                buffers.len()
            )));
        }
        let ready = Event::new()?;
        // SAFETY: recording on the legacy default stream (null), which libtorch computes on.
        check(
            unsafe { cudaEventRecord(ready.0, std::ptr::null_mut()) },
            "cudaEventRecord",
        )?;
        // SAFETY: both handles are live.
        check(
            unsafe { cudaStreamWaitEvent(self.stream, ready.0, 0) },
            "cudaStreamWaitEvent",
        )?;
        let mut host = Vec::with_capacity(tensors.len());
        let mut device = Vec::with_capacity(tensors.len());
        for (t, buf) in tensors.into_iter().zip(buffers) {
            let t = t.f_contiguous()?;
            let h = buf.view(&t.size(), t.kind())?;
            let bytes = t.numel() * t.kind().elt_size_in_bytes();
            // SAFETY: `h` is a page-locked host view of exactly `bytes` bytes and `t` a contiguous
            // device tensor of the same size; both stay alive in the PendingCopy until the copy's
            // completion event has been waited for, so the caching allocator cannot reuse them early.
            check(
                unsafe {
                    cudaMemcpyAsync(
                        h.data_ptr(),
                        t.data_ptr(),
                        bytes,
                        MEMCPY_DEVICE_TO_HOST,
                        self.stream,
                    )
                },
                "cudaMemcpyAsync",
            )?;
            host.push(h);
            device.push(t);
        }
        let done = Event::new()?;
        // SAFETY: both handles are live.
        check(
            unsafe { cudaEventRecord(done.0, self.stream) },
            "cudaEventRecord",
        )?;
        Ok(PendingCopy {
            host,
            device,
            done: Some(done),
        })
    }
}

/// Host memory page-locked with `cudaHostRegister` for as long as this value lives, so that
/// device-to-host copies into it run asynchronously at full speed. Allocated once and reused:
/// page-locking is far too slow to do per batch. (libtorch's own pinned allocation through
/// `pin_memory(device)` prints a deprecation warning on every call.)
pub struct PinnedBuffer {
    bytes: Tensor,
}

impl PinnedBuffer {
    /// `len` bytes of page-locked host memory.
    pub fn new(len: usize) -> Result<Self> {
        let mut bytes = Tensor::f_empty([len as i64], (tch::Kind::Uint8, tch::Device::Cpu))?;
        // Every page touched first, by libtorch's parallel fill: registering fresh memory faults
        // it in inside the driver call, one thread, 0.36–0.43 s for a DeepSeek-V3-cut batch set
        // of 1.17 GB on the H200; filled first it took 0.06–0.11 s and the registration 0.05 s
        // (docs/PERFORMANCE.md). Rank 0 pins sets on demand, so that time is its forward loop's.
        let _ = bytes.f_zero_()?;
        // SAFETY: registers exactly the `len` bytes this tensor owns; they stay allocated (the
        // tensor is owned by `self`) until Drop unregisters them.
        check(
            unsafe { cudaHostRegister(bytes.data_ptr(), len, 0) },
            "cudaHostRegister",
        )?;
        Ok(PinnedBuffer { bytes })
    }

    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        self.bytes.numel()
    }

    /// The first bytes of the buffer as a tensor of `shape` and `kind` (sharing its memory).
    pub fn view(&self, shape: &[i64], kind: tch::Kind) -> Result<Tensor> {
        let n = shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes();
        if n > self.len() {
            return Err(CaptureError::Cuda(format!(
                "{n} bytes do not fit a {}-byte host buffer",
                self.len()
            )));
        }
        Ok(self
            .bytes
            .f_narrow(0, 0, n as i64)?
            .f_view_dtype(kind)?
            .f_view(shape)?)
    }
}

/// A read-only host range (a mapped checkpoint file) page-locked in place for every device
/// for as long as this value lives, so that copies from it to a device run at the link's full
/// speed without a staging copy. The range must stay mapped until this value is dropped.
pub struct HostRegistration {
    ptr: *mut c_void,
}

// SAFETY: the registration is a process-wide driver state; unregistering from another thread is
// a plain runtime call.
unsafe impl Send for HostRegistration {}
// SAFETY: as above; the value is never used but to unregister.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Page-locks `len` bytes at `ptr` as read-only, portable host memory.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be mapped and stay mapped until the registration is dropped.
    pub unsafe fn read_only(ptr: *const u8, len: usize) -> Result<Self> {
        check(
            cudaHostRegister(
                ptr.cast_mut().cast(),
                len,
                HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY,
            ),
            "cudaHostRegister (read-only)",
        )?;
        Ok(HostRegistration {
            ptr: ptr.cast_mut().cast(),
        })
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // SAFETY: the pointer was registered in `read_only` and is still mapped.
        unsafe { cudaHostUnregister(self.ptr) };
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: the pointer was registered in `new` and the memory is still owned by `self.bytes`.
        unsafe { cudaHostUnregister(self.bytes.data_ptr()) };
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        // SAFETY: created by cudaStreamCreateWithFlags and destroyed once.
        unsafe { cudaStreamDestroy(self.stream) };
    }
}

/// Host copies in flight (or, on CPU, already there).
pub struct PendingCopy {
    host: Vec<Tensor>,
    device: Vec<Tensor>,
    done: Option<Event>,
}

impl PendingCopy {
    /// Tensors already in host memory (the CPU path): nothing to wait for.
    pub fn ready(host: Vec<Tensor>) -> Self {
        PendingCopy {
            host,
            device: vec![],
            done: None,
        }
    }

    /// Blocks until the copies are complete and returns the host tensors.
    pub fn wait(self) -> Result<Vec<Tensor>> {
        if let Some(done) = &self.done {
            // SAFETY: the event is live; synchronising only blocks this thread.
            check(
                unsafe { cudaEventSynchronize(done.0) },
                "cudaEventSynchronize",
            )?;
        }
        drop(self.device);
        Ok(self.host)
    }
}
