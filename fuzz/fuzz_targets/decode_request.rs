//! The server's request decoder on arbitrary bytes: it must never panic, a complete
//! request must re-encode to exactly the bytes it was decoded from, and a request
//! cut anywhere must read as incomplete, not invalid.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rallypoint_store::protocol::{decode_request, Decoded, Limits};

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        max_key_len: 256,
        max_value_len: 4096,
        max_keys: 64,
    };
    let mut at = 0;
    while at < data.len() {
        match decode_request(&data[at..], &limits) {
            Ok(Decoded::Complete(req, used)) => {
                assert!(used > 0 && at + used <= data.len());
                let mut again = Vec::new();
                req.encode(&mut again);
                assert_eq!(again, &data[at..at + used], "re-encoding differs");
                for cut in 0..used {
                    let partial = decode_request(&data[at..at + cut], &limits);
                    assert!(
                        matches!(partial, Ok(Decoded::Incomplete { needed }) if needed > cut),
                        "a prefix of a valid request must be incomplete"
                    );
                }
                at += used;
            }
            Ok(Decoded::Incomplete { needed }) => {
                assert!(needed > data.len() - at);
                break;
            }
            Err(_) => break,
        }
    }
});
