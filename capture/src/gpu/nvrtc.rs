//! NVRTC, the CUDA runtime compiler the torch wheel ships: our kernels are compiled from
//! source at first use, so a build needs no CUDA toolkit.
use std::ffi::{c_char, c_int, c_void, CStr, CString};

use crate::error::{CaptureError, Result};
use crate::gpu::cuda::{self, Library};

type NvrtcProgram = *mut c_void;

extern "C" {
    fn nvrtcCreateProgram(
        program: *mut NvrtcProgram,
        source: *const c_char,
        name: *const c_char,
        header_count: c_int,
        headers: *const *const c_char,
        include_names: *const *const c_char,
    ) -> c_int;
    fn nvrtcCompileProgram(
        program: NvrtcProgram,
        option_count: c_int,
        options: *const *const c_char,
    ) -> c_int;
    fn nvrtcGetPTXSize(program: NvrtcProgram, size: *mut usize) -> c_int;
    fn nvrtcGetPTX(program: NvrtcProgram, ptx: *mut c_char) -> c_int;
    fn nvrtcGetProgramLogSize(program: NvrtcProgram, size: *mut usize) -> c_int;
    fn nvrtcGetProgramLog(program: NvrtcProgram, log: *mut c_char) -> c_int;
    fn nvrtcDestroyProgram(program: *mut NvrtcProgram) -> c_int;
    fn nvrtcGetErrorString(result: c_int) -> *const c_char;
    fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> c_int;
    fn dladdr(addr: *const c_void, info: *mut DlInfo) -> c_int;
    fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void;
}

/// glibc's `Dl_info`.
#[repr(C)]
struct DlInfo {
    fname: *const c_char,
    base: *mut c_void,
    sname: *const c_char,
    saddr: *mut c_void,
}

const RTLD_NOW: c_int = 2;
const RTLD_GLOBAL: c_int = 0x100;

/// Loads NVRTC's builtins library from the folder our libnvrtc was loaded from. NVRTC opens it
/// by bare name, which only a library path or the caller's own search path finds; binaries
/// that reach the wheel's folder through their rpath alone (tests, `hslake` without
/// LD_LIBRARY_PATH) would not. Once loaded, the bare-name open finds it by its soname. A
/// failure here shows up as NVRTC's own error at compile time.
fn preload_builtins() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let (mut major, mut minor) = (0, 0);
        let mut info = DlInfo {
            fname: std::ptr::null(),
            base: std::ptr::null_mut(),
            sname: std::ptr::null(),
            saddr: std::ptr::null_mut(),
        };
        // SAFETY: valid out-pointers; `nvrtcCompileProgram` is a symbol of the loaded libnvrtc.
        let found = unsafe {
            nvrtcVersion(&mut major, &mut minor) == 0
                && dladdr(nvrtcCompileProgram as *const c_void, &mut info) != 0
                && !info.fname.is_null()
        };
        if !found {
            return;
        }
        // SAFETY: dladdr set `fname` to a NUL-terminated path that lives as long as the library.
        let lib = std::path::PathBuf::from(
            unsafe { CStr::from_ptr(info.fname) }
                .to_string_lossy()
                .into_owned(),
        );
        let Some(dir) = lib.parent() else { return };
        let builtins = dir.join(format!("libnvrtc-builtins.so.{major}.{minor}"));
        if let Ok(path) = CString::new(builtins.to_string_lossy().into_owned()) {
            // SAFETY: a NUL-terminated path; the handle is kept for the process's life.
            unsafe { dlopen(path.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
        }
    });
}

fn nvrtc_error(code: c_int, what: &str) -> CaptureError {
    // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string for any code.
    let msg = unsafe { CStr::from_ptr(nvrtcGetErrorString(code)) }.to_string_lossy();
    CaptureError::Cuda(format!("{what}: {msg} (NVRTC error {code})"))
}

fn nvrtc(code: c_int, what: &str) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(nvrtc_error(code, what))
    }
}

/// CUDA C++ `source` (no headers) compiled to PTX for compute capability `major.minor`; `name`
/// names it in compiler messages. No GPU needed.
pub(crate) fn compile_ptx(
    source: &str,
    name: &CStr,
    (major, minor): (i32, i32),
) -> Result<CString> {
    preload_builtins();
    let source =
        CString::new(source).map_err(|_| CaptureError::Cuda("kernel source holds a NUL".into()))?;
    let mut program: NvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid out-pointer and NUL-terminated strings; no headers.
    nvrtc(
        unsafe {
            nvrtcCreateProgram(
                &mut program,
                source.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        },
        "nvrtcCreateProgram",
    )?;
    let result = compile(program, major, minor);
    // SAFETY: `program` was created above and is destroyed once.
    unsafe { nvrtcDestroyProgram(&mut program) };
    result
}

fn compile(program: NvrtcProgram, major: i32, minor: i32) -> Result<CString> {
    let option = |o: String| {
        CString::new(o).map_err(|_| CaptureError::Cuda("an NVRTC option holds a NUL".into()))
    };
    let options = [
        option(format!("--gpu-architecture=compute_{major}{minor}"))?,
        option("--std=c++17".into())?,
    ];
    let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `program` is live; `pointers` holds NUL-terminated options that outlive the call.
    let compiled =
        unsafe { nvrtcCompileProgram(program, pointers.len() as c_int, pointers.as_ptr()) };
    if compiled != 0 {
        let mut size = 0;
        // SAFETY: valid out-pointer, then a buffer of exactly the reported size.
        let log = unsafe {
            nvrtcGetProgramLogSize(program, &mut size);
            let mut buf = vec![0u8; size.max(1)];
            nvrtcGetProgramLog(program, buf.as_mut_ptr().cast());
            String::from_utf8_lossy(&buf)
                .trim_end_matches('\0')
                .to_string()
        };
        return Err(CaptureError::Cuda(format!(
            "{}; compiler log:\n{log}",
            nvrtc_error(compiled, "nvrtcCompileProgram")
        )));
    }
    let mut size = 0;
    // SAFETY: valid out-pointer.
    nvrtc(
        unsafe { nvrtcGetPTXSize(program, &mut size) },
        "nvrtcGetPTXSize",
    )?;
    let mut ptx = vec![0u8; size];
    // SAFETY: `ptx` holds exactly the reported size, NUL included.
    nvrtc(
        unsafe { nvrtcGetPTX(program, ptx.as_mut_ptr().cast()) },
        "nvrtcGetPTX",
    )?;
    CString::from_vec_with_nul(ptx)
        .map_err(|e| CaptureError::Cuda(format!("NVRTC returned malformed PTX: {e}")))
}

/// The PTX `compile` makes for GPU `device`'s compute capability, loaded for the rest of the
/// process (the kernels taken from it must stay valid as long as they are cached).
pub(crate) fn load_library(
    device: usize,
    compile: impl FnOnce((i32, i32)) -> Result<CString>,
) -> Result<&'static Library> {
    let ptx = compile(cuda::compute_capability(device)?)?;
    Ok(Box::leak(Box::new(Library::load(&ptx)?)))
}
