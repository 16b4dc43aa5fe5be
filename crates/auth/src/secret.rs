//! The job secret: read from a file that only its owner may read, never from a command line.
//!
//! Every node of a job reads the same file (`--job-secret-file PATH`, or
//! [`ENV_VAR`] for processes started by hand). [`JobSecret::from_file`] refuses, with an error
//! that says what to do:
//!
//! - a file that its group or others may read or write (`mode & 0o077 != 0`): `chmod 600 PATH`;
//! - a file that is missing, unreadable, not a regular file, or over [`MAX_LEN`] bytes;
//! - a secret under [`MIN_LEN`] bytes, once one trailing `"\n"` or `"\r\n"` is stripped (so
//!   `echo` and editors may end the file with a newline): make one with
//!   `head -c 32 /dev/urandom > PATH` or `openssl rand -hex 32 > PATH`.
//!
//! The secret should be random bytes, not a password: anyone who can reach a listener gets a
//! keyed hash of known nonces (the server's proof), which lets them try guesses offline.
//!
//! The bytes live in one heap buffer, shared by clones ([`JobSecret`] is cheap to clone and
//! hand to every connection), and zeroed when the last clone drops. `Debug` and `Display` print
//! only the [`KeyId`]: a public fingerprint (the first 4 bytes of
//! `HMAC-SHA256(secret, "rallypoint key id")`, as 8 hex digits) for logs, so operators can see
//! that two nodes hold different secrets without either revealing its own.

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use zeroize::Zeroizing;

/// The environment variable naming the secret's file, for processes started by hand.
pub const ENV_VAR: &str = "RALLY_JOB_SECRET_FILE";

/// The shortest secret accepted, in bytes (after one trailing newline is stripped).
pub const MIN_LEN: usize = 16;

/// The longest file read, in bytes: a larger one is surely not a secret made for this.
pub const MAX_LEN: usize = 4096;

/// The input of the key id's HMAC.
const KEY_ID_LABEL: &[u8] = b"rallypoint key id";

/// The length of a [`KeyId`] in bytes (its text is twice as many hex digits).
pub const KEY_ID_LEN: usize = 4;

/// Why a job secret could not be had.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The file could not be opened or read.
    #[error("cannot read the job secret file {path}: {source}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The path is a directory, a device, a FIFO...
    #[error("the job secret file {path} is not a regular file")]
    NotAFile {
        /// The path.
        path: PathBuf,
    },
    /// Group or others may read or write the file.
    #[error(
        "the job secret file {path} has mode {mode:04o}: its group or others may read or write \
         it; only its owner may (run `chmod 600 {path}`)"
    )]
    TooOpen {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The secret is shorter than [`MIN_LEN`].
    #[error(
        "the job secret {source_name} holds {len} bytes (after one trailing newline is stripped); \
         at least {MIN_LEN} are needed: make one with `head -c 32 /dev/urandom > {hint}` or \
         `openssl rand -hex 32 > {hint}`"
    )]
    TooShort {
        /// Where it came from ("file PATH" or "given").
        source_name: String,
        /// The path to suggest in the commands.
        hint: String,
        /// Its length.
        len: usize,
    },
    /// The file is larger than [`MAX_LEN`].
    #[error(
        "the job secret file {path} is over {MAX_LEN} bytes: is it the right file? (make one with \
         `head -c 32 /dev/urandom > PATH`)"
    )]
    TooLong {
        /// The file.
        path: PathBuf,
    },
}

/// The job secret. Cheap to clone (the bytes are shared); zeroed when the last clone drops.
#[derive(Clone)]
pub struct JobSecret {
    bytes: Arc<Zeroizing<Vec<u8>>>,
    key_id: KeyId,
}

impl JobSecret {
    /// Reads the secret from `path`, refusing a file that group or others may read or write,
    /// and a secret under [`MIN_LEN`] bytes (after one trailing `"\n"` or `"\r\n"` is stripped).
    pub fn from_file(path: impl AsRef<Path>) -> Result<JobSecret, SecretError> {
        let path = path.as_ref();
        let unreadable = |source| SecretError::Unreadable {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(unreadable)?;
        // The mode of the file opened, not of the path looked up again: no race with a rename.
        let meta = file.metadata().map_err(unreadable)?;
        if !meta.is_file() {
            return Err(SecretError::NotAFile {
                path: path.to_owned(),
            });
        }
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(SecretError::TooOpen {
                path: path.to_owned(),
                mode,
            });
        }
        // Room for one byte past the limit, allocated once: no reallocation leaves a copy behind.
        let mut bytes = Zeroizing::new(Vec::with_capacity(MAX_LEN + 1));
        file.take(MAX_LEN as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(unreadable)?;
        if bytes.len() > MAX_LEN {
            return Err(SecretError::TooLong {
                path: path.to_owned(),
            });
        }
        let shown = path.display().to_string();
        JobSecret::from_parts(bytes, format!("file {shown}"), shown)
    }

    /// Reads the secret from the file named by [`ENV_VAR`]; `Ok(None)` when it is unset or empty.
    pub fn from_env() -> Result<Option<JobSecret>, SecretError> {
        match std::env::var_os(ENV_VAR) {
            Some(path) if !path.is_empty() => JobSecret::from_file(PathBuf::from(path)).map(Some),
            _ => Ok(None),
        }
    }

    /// A secret from bytes in memory (tests, or a caller with its own source), with the same
    /// trailing-newline and length rules as a file.
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<JobSecret, SecretError> {
        let bytes = Zeroizing::new(bytes.into());
        JobSecret::from_parts(bytes, "given".to_owned(), "PATH".to_owned())
    }

    fn from_parts(
        mut bytes: Zeroizing<Vec<u8>>,
        source_name: String,
        hint: String,
    ) -> Result<JobSecret, SecretError> {
        strip_one_newline(&mut bytes);
        if bytes.len() < MIN_LEN {
            return Err(SecretError::TooShort {
                source_name,
                hint,
                len: bytes.len(),
            });
        }
        let key_id = KeyId::of(&bytes);
        Ok(JobSecret {
            bytes: Arc::new(bytes),
            key_id,
        })
    }

    /// The public fingerprint of this secret, for logs and for the handshake's messages.
    pub fn key_id(&self) -> KeyId {
        self.key_id
    }

    /// A fresh HMAC-SHA256 keyed with the secret.
    pub(crate) fn mac(&self) -> Hmac<Sha256> {
        keyed(&self.bytes)
    }
}

fn keyed(key: &[u8]) -> Hmac<Sha256> {
    match <Hmac<Sha256> as Mac>::new_from_slice(key) {
        Ok(mac) => mac,
        // `InvalidLength` is for MACs with fixed key lengths; HMAC takes keys of any length
        // (a long one is hashed first), so it never returns it.
        Err(_) => unreachable!("HMAC-SHA256 refused a key of {} bytes", key.len()),
    }
}

/// Strips one trailing `"\r\n"` or `"\n"`, and no more.
fn strip_one_newline(bytes: &mut Vec<u8>) {
    if bytes.ends_with(b"\r\n") {
        bytes.truncate(bytes.len() - 2);
    } else if bytes.ends_with(b"\n") {
        bytes.truncate(bytes.len() - 1);
    }
}

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobSecret(redacted, key id {})", self.key_id)
    }
}

impl fmt::Display for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "job secret (redacted, key id {})", self.key_id)
    }
}

/// A public fingerprint of a job secret: the first [`KEY_ID_LEN`] bytes of
/// `HMAC-SHA256(secret, "rallypoint key id")`, shown as 8 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId(pub [u8; KEY_ID_LEN]);

impl KeyId {
    fn of(secret: &[u8]) -> KeyId {
        let mut mac = keyed(secret);
        mac.update(KEY_ID_LABEL);
        let tag = mac.finalize().into_bytes();
        let mut id = [0; KEY_ID_LEN];
        id.copy_from_slice(&tag[..KEY_ID_LEN]);
        KeyId(id)
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({self})")
    }
}

static PROCESS_SECRET: std::sync::OnceLock<JobSecret> = std::sync::OnceLock::new();

/// Sets this process's job secret (`rally` does so from `--job-secret-file`):
/// the default of every listener and client rallypoint makes in it from now
/// on. Once per process: a second call keeps the first and returns `false`
/// unless it is the same secret.
pub fn set_process_secret(secret: JobSecret) -> bool {
    let key = secret.key_id();
    PROCESS_SECRET.get_or_init(|| secret).key_id() == key
}

/// This process's job secret, if [`set_process_secret`] set one.
pub fn process_secret() -> Option<JobSecret> {
    PROCESS_SECRET.get().cloned()
}

/// The secret of a job's worker process: the process's ([`process_secret`])
/// if set, else the one in the file [`ENV_VAR`] names (read once; `rally
/// run --job-secret-file` gives its workers that variable, so the
/// collectives, RPC and fault-tolerance endpoints they serve and dial prove
/// it). A bad file is an error saying why, every time it is asked.
pub fn job_secret() -> Result<Option<JobSecret>, String> {
    static FROM_ENV: std::sync::OnceLock<Result<Option<JobSecret>, String>> =
        std::sync::OnceLock::new();
    if let Some(s) = process_secret() {
        return Ok(Some(s));
    }
    FROM_ENV
        .get_or_init(|| JobSecret::from_env().map_err(|e| format!("{ENV_VAR}: {e}")))
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::io::Write;

    fn write_secret(dir: &Path, bytes: &[u8], mode: u32) -> PathBuf {
        let path = dir.join("secret");
        let mut f = fs::File::create(&path).unwrap();
        f.write_all(bytes).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn a_private_file_of_32_bytes_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_secret(dir.path(), &[7; 32], 0o600);
        let secret = JobSecret::from_file(&path).unwrap();
        assert_eq!(secret.bytes.as_slice(), &[7; 32]);
        let read_only = write_secret(dir.path(), &[7; 32], 0o400);
        assert_eq!(
            JobSecret::from_file(read_only).unwrap().key_id(),
            secret.key_id()
        );
    }

    #[test]
    fn a_file_group_or_others_may_read_is_refused_naming_path_mode_and_chmod() {
        let dir = tempfile::tempdir().unwrap();
        for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o660] {
            let path = write_secret(dir.path(), &[7; 32], mode);
            let err = JobSecret::from_file(&path).unwrap_err();
            assert!(matches!(err, SecretError::TooOpen { mode: m, .. } if m == mode));
            let text = err.to_string();
            let shown = path.display().to_string();
            assert!(text.contains(&shown), "{text}");
            assert!(text.contains(&format!("mode {mode:04o}")), "{text}");
            assert!(text.contains(&format!("chmod 600 {shown}")), "{text}");
        }
    }

    #[test]
    fn a_15_byte_secret_is_refused_with_its_length_the_minimum_and_how_to_make_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_secret(dir.path(), b"fifteen-bytes!!", 0o600);
        let err = JobSecret::from_file(&path).unwrap_err();
        assert!(matches!(err, SecretError::TooShort { len: 15, .. }));
        let text = err.to_string();
        assert!(text.contains("holds 15 bytes"), "{text}");
        assert!(text.contains("at least 16"), "{text}");
        let shown = path.display().to_string();
        assert!(
            text.contains(&format!("head -c 32 /dev/urandom > {shown}")),
            "{text}"
        );
        assert!(
            text.contains(&format!("openssl rand -hex 32 > {shown}")),
            "{text}"
        );
        // 16 bytes is enough.
        let path = write_secret(dir.path(), b"sixteen-bytes!!!", 0o600);
        JobSecret::from_file(path).unwrap();
    }

    #[test]
    fn one_trailing_newline_is_stripped_and_only_one() {
        let base = b"0123456789abcdef0123".to_vec();
        let plain = JobSecret::from_bytes(base.clone()).unwrap();
        for suffix in [&b"\n"[..], b"\r\n"] {
            let with = JobSecret::from_bytes([&base[..], suffix].concat()).unwrap();
            assert_eq!(with.bytes.as_slice(), base.as_slice());
            assert_eq!(with.key_id(), plain.key_id());
        }
        let two = JobSecret::from_bytes([&base[..], b"\n\n"].concat()).unwrap();
        assert_eq!(two.bytes.as_slice(), [&base[..], b"\n"].concat().as_slice());
        assert_ne!(two.key_id(), plain.key_id());
        // A 16-byte secret whose newline makes it 17 in the file is 16, and one of 15 plus
        // a newline is still too short.
        JobSecret::from_bytes(b"sixteen-bytes!!!\n".to_vec()).unwrap();
        let err = JobSecret::from_bytes(b"fifteen-bytes!!\r\n".to_vec()).unwrap_err();
        assert!(matches!(err, SecretError::TooShort { len: 15, .. }));
    }

    #[test]
    fn a_missing_file_a_directory_and_a_huge_file_are_refused_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let err = JobSecret::from_file(&missing).unwrap_err();
        assert!(matches!(err, SecretError::Unreadable { .. }));
        assert!(err.to_string().contains(&missing.display().to_string()));

        let sub = dir.path().join("sub");
        fs::create_dir(&sub).unwrap();
        fs::set_permissions(&sub, fs::Permissions::from_mode(0o700)).unwrap();
        let err = JobSecret::from_file(&sub).unwrap_err();
        assert!(matches!(err, SecretError::NotAFile { .. }), "{err}");

        let huge = write_secret(dir.path(), &vec![1; MAX_LEN + 1], 0o600);
        let err = JobSecret::from_file(&huge).unwrap_err();
        assert!(matches!(err, SecretError::TooLong { .. }), "{err}");
        let at_limit = write_secret(dir.path(), &vec![1; MAX_LEN], 0o600);
        JobSecret::from_file(at_limit).unwrap();
    }

    #[test]
    fn debug_and_display_show_the_key_id_and_never_the_secret() {
        let secret = JobSecret::from_bytes(b"very-secret-value-xyz".to_vec()).unwrap();
        for text in [format!("{secret:?}"), format!("{secret}")] {
            assert!(!text.contains("very-secret"), "{text}");
            assert!(text.contains("redacted"), "{text}");
            assert!(text.contains(&secret.key_id().to_string()), "{text}");
        }
    }

    #[test]
    fn the_key_id_is_the_first_4_bytes_of_the_hmac_of_its_label() {
        // HMAC-SHA256(key = "0123456789abcdef", "rallypoint key id"), from Python's hmac module.
        let secret = JobSecret::from_bytes(b"0123456789abcdef".to_vec()).unwrap();
        assert_eq!(secret.key_id().to_string(), KNOWN_KEY_ID);
        assert_eq!(secret.key_id().to_string().len(), 2 * KEY_ID_LEN);
        let other = JobSecret::from_bytes(b"0123456789abcdeF".to_vec()).unwrap();
        assert_ne!(other.key_id(), secret.key_id());
    }

    const KNOWN_KEY_ID: &str = "f6e16944";

    #[test]
    fn from_env_is_none_when_unset_or_empty_and_reads_the_named_file() {
        // The only test of this binary that touches the variable.
        let dir = tempfile::tempdir().unwrap();
        let path = write_secret(dir.path(), &[9; 20], 0o600);
        std::env::remove_var(ENV_VAR);
        assert!(JobSecret::from_env().unwrap().is_none());
        std::env::set_var(ENV_VAR, "");
        assert!(JobSecret::from_env().unwrap().is_none());
        std::env::set_var(ENV_VAR, &path);
        let secret = JobSecret::from_env().unwrap().unwrap();
        assert_eq!(secret.bytes.as_slice(), &[9; 20]);
        std::env::set_var(ENV_VAR, dir.path().join("absent"));
        assert!(JobSecret::from_env().is_err());
        std::env::remove_var(ENV_VAR);
    }
}
