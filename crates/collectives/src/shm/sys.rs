//! The few Linux calls shared memory needs: an anonymous memory file
//! (`memfd_create`), opened by other processes through `/proc/<pid>/fd/<fd>`,
//! mapped shared; futex waits and wakes on words in that mapping; and a pidfd
//! per peer, which becomes readable when the peer's process ends (even
//! before it is reaped).
//!
//! A memory file has no name anywhere: it lives while a process holds it open
//! or mapped, so a rank killed at any moment leaves nothing behind (nothing in
//! `/dev/shm` to sweep). On other systems every call fails with `Unsupported`
//! and groups use TCP.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

#[cfg(target_os = "linux")]
mod imp {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd};

    fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }

    /// Whether this process can create memory files and open pidfds
    /// (kernels before 5.3, or a seccomp profile, may refuse either).
    pub fn supported() -> bool {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| memfd(64).is_ok() && pidfd(std::process::id()).is_ok())
    }

    /// A new anonymous memory file of `len` bytes (zeros).
    pub fn memfd(len: usize) -> io::Result<OwnedFd> {
        // SAFETY: a valid C string; the returned descriptor is ours.
        let fd = cvt(unsafe { libc::memfd_create(c"rallypoint-shm".as_ptr(), libc::MFD_CLOEXEC) })?;
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a plain syscall on a descriptor we own.
        cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) })?;
        Ok(fd)
    }

    /// What `/proc/<pid>/fd/<fd>` of one of our memory files reads as.
    const MEMFD_LINK: &str = "/memfd:rallypoint-shm";

    /// Whether the descriptor behind `link` (a `/proc/.../fd/<n>` path) is
    /// one of our memory files, by its name.
    fn is_our_memfd(link: &str) -> io::Result<bool> {
        let target = std::fs::read_link(link)?;
        let t = target.to_string_lossy();
        Ok(t == MEMFD_LINK || t.starts_with(&format!("{MEMFD_LINK} ")))
    }

    /// Opens descriptor `fd` of process `pid`, a memory file it created.
    ///
    /// The number came from the store and may name something else by now
    /// (the process closed the file and the number was reused, or another
    /// process has the pid): a terminal, a pipe, a device whose opening does
    /// something. So the link is checked to name one of our memory files
    /// before anything is opened, opened without becoming a controlling
    /// terminal, and what was opened is checked again (a regular file, our
    /// memory file) before the caller maps it. `InvalidData` names what the
    /// number was instead.
    pub fn open_of(pid: u32, fd: i32) -> io::Result<OwnedFd> {
        let link = format!("/proc/{pid}/fd/{fd}");
        let not_ours = |what: String| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{link} is {what}, not a rallypoint memory file"),
            )
        };
        if !is_our_memfd(&link)? {
            let target = std::fs::read_link(&link)?;
            return Err(not_ours(format!("{target:?}")));
        }
        let path = std::ffi::CString::new(link.clone()).expect("no NUL");
        // SAFETY: a valid C string; the returned descriptor is ours.
        let raw = cvt(unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOCTTY,
            )
        })?;
        // SAFETY: `raw` was just opened and is owned by nothing else.
        let opened = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `st` is written by fstat before it is read.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a valid place for fstat to write.
        cvt(unsafe { libc::fstat(opened.as_raw_fd(), &mut st) })?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(not_ours("not a regular file once opened".into()));
        }
        // The number may have been reused between the check and the open.
        if !is_our_memfd(&format!("/proc/self/fd/{raw}"))? {
            return Err(not_ours("another file once opened".into()));
        }
        Ok(opened)
    }

    pub fn file_len(fd: &OwnedFd) -> io::Result<u64> {
        // SAFETY: `st` is written by fstat before it is read.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a valid place for fstat to write.
        cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
        Ok(st.st_size as u64)
    }

    /// Maps `len` bytes of `fd` shared, read and write.
    pub fn map(fd: &OwnedFd, len: usize) -> io::Result<*mut u8> {
        // SAFETY: a fresh mapping chosen by the kernel; checked for failure.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(p.cast())
    }

    /// # Safety
    /// `p..p+len` must be a mapping from [`map`] that nothing uses any more.
    pub unsafe fn unmap(p: *mut u8, len: usize) {
        libc::munmap(p.cast(), len);
    }

    /// Whether process `pid` has ended: its pidfd is readable, or there is
    /// no such process. `None` when that cannot be told (a refused
    /// `pidfd_open`, too many open files).
    pub fn pid_ended(pid: u32) -> Option<bool> {
        match pidfd(pid) {
            Ok(fd) => Some(ended(&fd)),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Some(true),
            Err(_) => None,
        }
    }

    /// A pidfd for `pid`.
    pub fn pidfd(pid: u32) -> io::Result<OwnedFd> {
        // SAFETY: a plain syscall; the returned descriptor is ours.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    /// Whether the process behind `pidfd` has ended.
    pub fn ended(pidfd: &OwnedFd) -> bool {
        let mut p = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        r > 0 && p.revents & libc::POLLIN != 0
    }

    /// Sleeps while `word` holds `seen`, at most `max` (a wake, a signal or
    /// a changed word return early). Shared between processes: no
    /// `FUTEX_PRIVATE_FLAG`.
    pub fn futex_wait(word: &AtomicU32, seen: u32, max: Duration) {
        let ts = libc::timespec {
            tv_sec: max.as_secs() as libc::time_t,
            tv_nsec: max.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `word` is a live, aligned u32; `ts` outlives the call.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// Wakes every process sleeping on `word`.
    pub fn futex_wake(word: &AtomicU32) {
        // SAFETY: `word` is a live, aligned u32.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::*;

    fn no<T>() -> io::Result<T> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "shared memory between ranks needs Linux",
        ))
    }
    pub fn supported() -> bool {
        false
    }
    pub fn memfd(_: usize) -> io::Result<OwnedFd> {
        no()
    }
    pub fn open_of(_: u32, _: i32) -> io::Result<OwnedFd> {
        no()
    }
    pub fn file_len(_: &OwnedFd) -> io::Result<u64> {
        no()
    }
    pub fn map(_: &OwnedFd, _: usize) -> io::Result<*mut u8> {
        no()
    }
    pub unsafe fn unmap(_: *mut u8, _: usize) {}
    pub fn pidfd(_: u32) -> io::Result<OwnedFd> {
        no()
    }
    pub fn pid_ended(_: u32) -> Option<bool> {
        None
    }
    pub fn ended(_: &OwnedFd) -> bool {
        false
    }
    pub fn futex_wait(_: &AtomicU32, _: u32, max: Duration) {
        std::thread::sleep(max.min(Duration::from_millis(1)));
    }
    pub fn futex_wake(_: &AtomicU32) {}
}

pub(crate) use imp::*;
