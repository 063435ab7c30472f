//! The memory hook, process-wide, for handlers opened after it is set: registers the
//! staging buffer (and `cxl`'s mappings) with the runtime's GPU driver before the
//! first transfer, unregisters on close. `None`; `Callbacks` (a failing `register`
//! fails the open); `Auto` (libcudart's `cudaHostRegister`, `MARU_CUDART` to name
//! another library; without CUDA it logs and goes on with pageable memory).

use super::error::WorkerError;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::Mutex;

/// `register(ctx, ptr, len)`: 0 on success.
pub type RegisterFn = unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, len: usize) -> i32;
/// `unregister(ctx, ptr, len)`.
pub type UnregisterFn = unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, len: usize);

#[derive(Clone, Copy, Debug, Default)]
pub enum MemoryHook {
    #[default]
    None,
    Auto,
    Callbacks {
        register: RegisterFn,
        unregister: Option<UnregisterFn>,
        /// The runtime's context pointer, passed back unchanged.
        ctx: usize,
    },
}

static HOOK: Mutex<MemoryHook> = Mutex::new(MemoryHook::None);

/// Bytes registered (pinned) by the hook now, over every handler of the process.
static PINNED_BYTES: AtomicU64 = AtomicU64::new(0);
/// Registrations that failed or pinned nothing (auto without CUDA) since start.
static REGISTER_FAILURES: AtomicU64 = AtomicU64::new(0);

/// The process-wide hook counters: bytes registered now, failed registrations so far.
pub fn hook_counters() -> (u64, u64) {
    (
        PINNED_BYTES.load(AtomicOrdering::Relaxed),
        REGISTER_FAILURES.load(AtomicOrdering::Relaxed),
    )
}

/// `MARU_CUDART` must be an absolute path: a relative one would be looked up in the
/// library search path and the current directory of the moment, not where it says.
pub fn check_cudart_env() -> Result<(), String> {
    match std::env::var("MARU_CUDART") {
        Ok(p) if !p.is_empty() && !std::path::Path::new(&p).is_absolute() => Err(format!(
            "MARU_CUDART={p} is a relative path: give the absolute path of libcudart.so (or unset it to search libcudart.so, .so.12, .so.11.0)"
        )),
        _ => Ok(()),
    }
}

/// Sets the hook for handlers opened from now on.
pub fn set_memory_hook(h: MemoryHook) {
    if let Ok(mut g) = HOOK.lock() {
        *g = h;
    }
}

/// The hook in force now.
pub fn memory_hook() -> MemoryHook {
    HOOK.lock().map(|g| *g).unwrap_or(MemoryHook::None)
}

/// `cudaHostRegisterPortable`: pinned for every CUDA context.
const CUDA_HOST_REGISTER_PORTABLE: u32 = 1;

type CudaRegister = unsafe extern "C" fn(*mut c_void, usize, u32) -> i32;
type CudaUnregister = unsafe extern "C" fn(*mut c_void) -> i32;

struct Cudart {
    path: String,
    register: CudaRegister,
    unregister: CudaUnregister,
}

/// Finds libcudart once per process. The library is never closed (CUDA does not
/// support being unloaded while contexts live).
fn cudart() -> &'static Result<Cudart, String> {
    static CUDART: std::sync::OnceLock<Result<Cudart, String>> = std::sync::OnceLock::new();
    CUDART.get_or_init(|| {
        check_cudart_env()?;
        let candidates: Vec<String> = match std::env::var("MARU_CUDART") {
            Ok(p) if !p.is_empty() => vec![p],
            _ => ["libcudart.so", "libcudart.so.12", "libcudart.so.11.0"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        };
        let mut tried = Vec::new();
        for name in &candidates {
            let Ok(c) = CString::new(name.as_str()) else {
                continue;
            };
            // SAFETY: dlopen with a NUL-terminated name; the handle is checked.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if h.is_null() {
                tried.push(format!("{name}: {}", dl_error()));
                continue;
            }
            // SAFETY: symbol lookups in a library we just opened; checked for NULL.
            let (r, u) = unsafe {
                (
                    libc::dlsym(h, c"cudaHostRegister".as_ptr()),
                    libc::dlsym(h, c"cudaHostUnregister".as_ptr()),
                )
            };
            if r.is_null() || u.is_null() {
                tried.push(format!(
                    "{name}: no cudaHostRegister/cudaHostUnregister symbols"
                ));
                continue;
            }
            // SAFETY: the symbols have the CUDA runtime's documented signatures.
            let (register, unregister) = unsafe {
                (
                    std::mem::transmute::<*mut c_void, CudaRegister>(r),
                    std::mem::transmute::<*mut c_void, CudaUnregister>(u),
                )
            };
            return Ok(Cudart {
                path: name.clone(),
                register,
                unregister,
            });
        }
        Err(tried.join("; "))
    })
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated message.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown dlopen error".into()
        } else {
            std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// One registered buffer; unregistered once, by `release` or on drop.
pub struct Registration {
    how: Registered,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is only passed back to the hook, never dereferenced here.
unsafe impl Send for Registration {}
unsafe impl Sync for Registration {}

enum Registered {
    Nothing,
    Cuda(&'static Cudart),
    Callbacks {
        unregister: Option<UnregisterFn>,
        ctx: usize,
    },
}

/// Registers `ptr..ptr+len` (the staging buffer) with `hook` (the handler's: the one
/// in force when it was opened).
pub fn register(ptr: *mut u8, len: usize, hook: MemoryHook) -> Result<Registration, WorkerError> {
    register_as(ptr, len, "the staging buffer", hook).map_err(|e| match e {
        WorkerError::Config(m) => WorkerError::Config(format!("{m}; the handler is not opened")),
        e => e,
    })
}

/// Registers `ptr..ptr+len` with `hook`, named `what` in logs and errors.
fn register_as(
    ptr: *mut u8,
    len: usize,
    what: &str,
    hook: MemoryHook,
) -> Result<Registration, WorkerError> {
    let how = match hook {
        MemoryHook::None => Registered::Nothing,
        MemoryHook::Auto => match cudart() {
            Ok(c) => {
                // SAFETY: a live mapping of `len` bytes, as cudaHostRegister expects.
                let rc = unsafe { (c.register)(ptr.cast(), len, CUDA_HOST_REGISTER_PORTABLE) };
                if rc == 0 {
                    log::info!(
                        "memory hook auto: {what} ({len} bytes) pinned with cudaHostRegister ({})",
                        c.path
                    );
                    Registered::Cuda(c)
                } else {
                    log::warn!(
                        "memory hook auto: cudaHostRegister of {what} ({len} bytes) failed with CUDA error {rc}; GPU copies use pageable memory"
                    );
                    REGISTER_FAILURES.fetch_add(1, AtomicOrdering::Relaxed);
                    Registered::Nothing
                }
            }
            Err(why) => {
                REGISTER_FAILURES.fetch_add(1, AtomicOrdering::Relaxed);
                log::warn!(
                    "memory hook auto: libcudart not found ({why}); {what} is not pinned (set MARU_CUDART to the library's path if CUDA is installed elsewhere)"
                );
                Registered::Nothing
            }
        },
        MemoryHook::Callbacks {
            register,
            unregister,
            ctx,
        } => {
            // SAFETY: the runtime's callback, called with its own context and a live buffer.
            let rc = unsafe { register(ctx as *mut c_void, ptr.cast(), len) };
            if rc != 0 {
                REGISTER_FAILURES.fetch_add(1, AtomicOrdering::Relaxed);
                log::warn!("memory hook: register returned {rc} for {what} ({len} bytes)");
                return Err(WorkerError::Config(format!(
                    "the memory hook's register callback returned {rc} for {what} ({len} bytes at {ptr:p})"
                )));
            }
            log::info!("memory hook: {what} ({len} bytes) registered");
            Registered::Callbacks { unregister, ctx }
        }
    };
    if !matches!(how, Registered::Nothing) {
        PINNED_BYTES.fetch_add(len as u64, AtomicOrdering::Relaxed);
    }
    Ok(Registration { how, ptr, len })
}

impl Registration {
    /// Unregisters now (idempotent).
    pub fn release(&mut self) {
        let how = std::mem::replace(&mut self.how, Registered::Nothing);
        if !matches!(how, Registered::Nothing) {
            PINNED_BYTES.fetch_sub(self.len as u64, AtomicOrdering::Relaxed);
        }
        match how {
            Registered::Nothing => {}
            Registered::Cuda(c) => {
                // SAFETY: the pointer cudaHostRegister accepted, still mapped.
                let rc = unsafe { (c.unregister)(self.ptr.cast()) };
                if rc != 0 {
                    log::warn!("memory hook auto: cudaHostUnregister failed with CUDA error {rc}");
                }
            }
            Registered::Callbacks {
                unregister: Some(u),
                ctx,
            } => {
                // SAFETY: the runtime's callback with what `register` was given.
                unsafe { u(ctx as *mut c_void, self.ptr.cast(), self.len) }
            }
            Registered::Callbacks { .. } => {}
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.release();
    }
}

/// The memory-hook registrations of a `cxl` mover's mappings: each registered once
/// when made, unregistered once before it can be unmapped; a refusal is logged and
/// the mapping used unregistered.
#[derive(Default)]
pub struct MappingHooks {
    regs: Vec<(u64, Registration)>,
    /// The hook in force when the handler opened.
    hook: MemoryHook,
}

impl MappingHooks {
    /// Registrations made with `hook`.
    pub fn new(hook: MemoryHook) -> MappingHooks {
        MappingHooks {
            regs: Vec::new(),
            hook,
        }
    }

    /// Registers the mapping of region `region_id` (each mapping once).
    pub fn add(&mut self, region_id: u64, map: &crate::dax::Mapping) {
        let ptr = map.as_ptr();
        if self.regs.iter().any(|(_, r)| r.ptr == ptr) {
            return;
        }
        let what = format!("the CXL mapping of region {region_id}");
        match register_as(ptr, map.len(), &what, self.hook) {
            Ok(r) => self.regs.push((region_id, r)),
            Err(e) => log::warn!("{e}; {what} stays unregistered"),
        }
    }

    /// Unregisters every mapping of region `region_id`.
    pub fn remove_region(&mut self, region_id: u64) {
        // Dropping a registration unregisters it.
        self.regs.retain(|(r, _)| *r != region_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static REGS: AtomicUsize = AtomicUsize::new(0);
    static UNREGS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn reg(ctx: *mut c_void, _p: *mut c_void, len: usize) -> i32 {
        assert_eq!(ctx as usize, 42);
        REGS.fetch_add(len, Ordering::SeqCst);
        0
    }
    unsafe extern "C" fn unreg(ctx: *mut c_void, _p: *mut c_void, len: usize) {
        assert_eq!(ctx as usize, 42);
        UNREGS.fetch_add(len, Ordering::SeqCst);
    }
    unsafe extern "C" fn refuse(_c: *mut c_void, _p: *mut c_void, _l: usize) -> i32 {
        -7
    }

    // One test, because the hook is process-wide.
    #[test]
    fn callbacks_are_called_once_each_and_a_refusal_fails() {
        let mut buf = vec![0u8; 4096];
        set_memory_hook(MemoryHook::Callbacks {
            register: reg,
            unregister: Some(unreg),
            ctx: 42,
        });
        let mut r = register(buf.as_mut_ptr(), 4096, memory_hook()).unwrap();
        assert_eq!(REGS.load(Ordering::SeqCst), 4096);
        r.release();
        drop(r);
        assert_eq!(
            UNREGS.load(Ordering::SeqCst),
            4096,
            "unregistered exactly once"
        );
        set_memory_hook(MemoryHook::Callbacks {
            register: refuse,
            unregister: None,
            ctx: 0,
        });
        let e = register(buf.as_mut_ptr(), 4096, memory_hook())
            .err()
            .unwrap();
        assert!(e.to_string().contains("returned -7"), "{e}");
        set_memory_hook(MemoryHook::None);
        assert!(register(buf.as_mut_ptr(), 4096, memory_hook()).is_ok());
    }
}
