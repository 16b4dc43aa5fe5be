//! The one hash every rank must compute alike: FNV-1a (64 bits), fixed
//! forever, so that ranks built by different toolchains agree. It names
//! internal groups ([`stable_hash`]), checks set-up (the options' layout)
//! and folds the history of calls ([`crate::frame::hist_after`]).

/// FNV-1a (64 bits) of `bytes`.
pub(crate) fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// FNV-1a (64 bits) of `words` in little-endian order: the same on every
/// platform and toolchain, forever.
pub(crate) fn stable_hash(words: &[u64]) -> u64 {
    fnv1a(words.iter().flat_map(|w| w.to_le_bytes()))
}
