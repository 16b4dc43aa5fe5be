//! Type fingerprints: what a function takes and returns, and what an RRef
//! holds, checked across the wire.
//!
//! Rust has no stable type identity between builds, so a type is named by
//! its *shape*: [`std::any::type_name`] with every module path dropped
//! (`alloc::vec::Vec<my_app::Point>` is `Vec<Point>`). Two workers built from
//! different crates that define the same `Point` agree; `(i64, i64)` and
//! `i64` do not. A fingerprint is a fixed 64-bit FNV-1a hash of the shape
//! (never `DefaultHasher`, whose algorithm may change between Rust
//! releases), so a call carries 16 bytes, and the names are only spelled
//! out in the error when the two sides disagree.

/// The shape of a type's name: module paths dropped.
pub fn shape(type_name: &str) -> String {
    let mut out = String::with_capacity(type_name.len());
    let mut token = String::new();
    let flush = |token: &mut String, out: &mut String| {
        out.push_str(token.rsplit("::").next().unwrap_or(""));
        token.clear();
    };
    for c in type_name.chars() {
        if c.is_alphanumeric() || c == '_' || c == ':' {
            token.push(c);
        } else {
            flush(&mut token, &mut out);
            out.push(c);
        }
    }
    flush(&mut token, &mut out);
    out
}

/// The fingerprint of `T`'s shape.
pub fn fingerprint<T: ?Sized>() -> u64 {
    fnv1a(shape(std::any::type_name::<T>()).as_bytes())
}

/// FNV-1a, 64 bits: fixed forever, unlike `DefaultHasher`.
pub fn fnv1a(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in b {
        h ^= *x as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// What a call expects: the fingerprints of its argument and result types
/// (zero: not checked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Sig {
    pub args: u64,
    pub ret: u64,
}

impl Sig {
    pub fn of<A: ?Sized, R: ?Sized>() -> Sig {
        Sig {
            args: fingerprint::<A>(),
            ret: fingerprint::<R>(),
        }
    }
}

/// A function's or method's types as registered, by name (for errors) and
/// by fingerprint.
#[derive(Debug, Clone)]
pub struct Signature {
    pub args: String,
    pub ret: String,
    pub sig: Sig,
}

impl Signature {
    pub fn of<A: ?Sized, R: ?Sized>() -> Signature {
        Signature {
            args: shape(std::any::type_name::<A>()),
            ret: shape(std::any::type_name::<R>()),
            sig: Sig::of::<A, R>(),
        }
    }

    /// Whether a call expecting `want` may run this (zero parts are not
    /// checked).
    pub fn accepts(&self, want: Sig) -> bool {
        (want.args == 0 || want.args == self.sig.args)
            && (want.ret == 0 || want.ret == self.sig.ret)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_drop_module_paths_only() {
        assert_eq!(shape("alloc::vec::Vec<my_app::Point>"), "Vec<Point>");
        assert_eq!(shape("(i64, i64)"), "(i64, i64)");
        assert_eq!(
            shape("core::option::Option<&'static str>"),
            "Option<&'static str>"
        );
        assert_eq!(
            shape(std::any::type_name::<
                std::collections::HashMap<String, [u8; 4]>,
            >()),
            "HashMap<String, [u8; 4]>"
        );
        assert_ne!(fingerprint::<(i64, i64)>(), fingerprint::<i64>());
        assert_eq!(fingerprint::<Vec<u8>>(), fnv1a(b"Vec<u8>"));
    }

    #[test]
    fn the_hash_is_fixed() {
        // FNV-1a test vectors: these must never change.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
