//! Line handling: the pump cuts each teed stream into console segments
//! ([`Lines`]): lines, `\r`-ended progress updates, a partial line once it has
//! waited (`PARTIAL_AFTER`), and pieces of [`MAX_LINE`] bytes of a line without
//! end, each with the worker's prefix where a line starts. `\r\n` is one line
//! ending, even cut between two reads: an update ending a read shows at once
//! and its `\r` goes out with the next byte. Pure: no I/O, tested byte by byte.

use std::sync::Arc;

/// A line longer than this is shown in pieces of this size, so a stream without
/// newlines cannot grow the launcher's memory.
pub const MAX_LINE: usize = 64 * 1024;

/// Console output cut from a stream, ready to queue.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Out {
    pub(super) bytes: Vec<u8>,
    pub(super) continues: bool,
    pub(super) open: bool,
    pub(super) count: u64,
}

/// Cuts a stream into prefixed console segments: lines ended by `\n`, progress
/// updates ended by `\r` (the next update overwrites it, prefix and all, so it
/// gets its own prefix), and pieces of a line that is partial for too long
/// ([`Lines::flush`]) or longer than [`MAX_LINE`]. Memory per stream stays under
/// [`MAX_LINE`].
pub(super) struct Lines {
    pub(super) prefix: Arc<[u8]>,
    /// The current line's bytes not yet sent.
    pub(super) pending: Vec<u8>,
    /// Part of the current line was sent already: what follows continues it.
    pub(super) open_on_console: bool,
}

impl Lines {
    pub(super) fn new(prefix: &str) -> Lines {
        Lines {
            prefix: prefix.as_bytes().into(),
            pending: Vec::new(),
            open_on_console: false,
        }
    }

    /// Appends `chunk`; returns the segments it completes.
    pub(super) fn feed(&mut self, chunk: &[u8]) -> Option<Out> {
        let mut out = Out {
            bytes: Vec::new(),
            continues: false,
            open: false,
            count: 0,
        };
        // A `\r` held back (it ended the last chunk): ended by `\r\n`, or a
        // progress update of its own.
        if self.pending.last() == Some(&b'\r') && chunk.first() != Some(&b'\n') && !chunk.is_empty()
        {
            self.segment(&mut out, b"", false);
        }
        let mut start = 0;
        for end in memchr::memchr2_iter(b'\n', b'\r', chunk) {
            if chunk[end] == b'\r' {
                match chunk.get(end + 1) {
                    // `\r\n` is one line ending (Windows-style output).
                    Some(b'\n') => continue,
                    // The chunk's last byte: the update shows now, its `\r`
                    // waits for the next byte to say what it ends.
                    None => {
                        self.segment(&mut out, &chunk[start..end], true);
                        self.pending.push(b'\r');
                        return Some(out);
                    }
                    Some(_) => {}
                }
            }
            self.segment(&mut out, &chunk[start..=end], false);
            start = end + 1;
        }
        let mut tail = &chunk[start..];
        while self.pending.len() + tail.len() >= MAX_LINE {
            let take = MAX_LINE - self.pending.len();
            self.segment(&mut out, &tail[..take], true);
            tail = &tail[take..];
        }
        self.pending.extend_from_slice(tail);
        (out.count > 0).then_some(out)
    }

    /// Sends what is pending of the current line: as an open segment, or, at the
    /// end of the stream, ended with a newline.
    pub(super) fn flush(&mut self, last: bool) -> Option<Out> {
        // A `\r` held back stays back (a `\n` may follow), except at the end.
        let held = !last && self.pending.last() == Some(&b'\r');
        if held {
            self.pending.pop();
        }
        if self.pending.is_empty() && !(last && self.open_on_console) {
            if held {
                self.pending.push(b'\r');
            }
            return None;
        }
        let mut out = Out {
            bytes: Vec::new(),
            continues: false,
            open: false,
            count: 0,
        };
        if last && self.pending.last() == Some(&b'\r') {
            // Ended by its `\r`.
            self.segment(&mut out, b"", false);
        } else if last {
            self.segment(&mut out, b"\n", false);
        } else {
            self.segment(&mut out, b"", true);
        }
        if held {
            self.pending.push(b'\r');
        }
        Some(out)
    }

    /// Emits `pending + piece` as one segment; `open`: the line goes on after it.
    fn segment(&mut self, out: &mut Out, piece: &[u8], open: bool) {
        if out.count == 0 && self.open_on_console {
            out.continues = true;
        } else if !self.open_on_console {
            out.bytes.extend_from_slice(&self.prefix);
        }
        out.bytes.extend_from_slice(&self.pending);
        out.bytes.extend_from_slice(piece);
        self.pending.clear();
        self.open_on_console = open;
        out.open = open;
        out.count += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lines() -> Lines {
        Lines::new("[w0]:")
    }

    #[test]
    fn complete_lines_are_prefixed_and_the_tail_waits() {
        let mut l = lines();
        let out = l.feed(b"a\nbc\nde").unwrap();
        assert_eq!(out.bytes, b"[w0]:a\n[w0]:bc\n");
        assert!(!out.continues && !out.open);
        assert_eq!(out.count, 2);
        let out = l.feed(b"f\n").unwrap();
        assert_eq!(out.bytes, b"[w0]:def\n");
    }

    #[test]
    fn a_carriage_return_shows_a_progress_update_at_once() {
        let mut l = lines();
        let out = l.feed(b" 10%|#   |\r 20%|##  |\r").unwrap();
        // The last update shows at once; its `\r` goes out with what follows
        // (a `\n` would make `\r\n` one line ending).
        assert_eq!(out.bytes, b"[w0]: 10%|#   |\r[w0]: 20%|##  |");
        assert!(out.open);
        assert_eq!(l.feed(b"100%").unwrap().bytes, b"\r");
        assert_eq!(l.flush(true).unwrap().bytes, b"[w0]:100%\n");
    }

    #[test]
    fn a_quiet_partial_line_is_shown_and_its_rest_continues_it() {
        let mut l = lines();
        assert_eq!(l.feed(b"Password: "), None);
        let out = l.flush(false).unwrap();
        assert_eq!(out.bytes, b"[w0]:Password: ");
        assert!(out.open && !out.continues);
        assert_eq!(l.flush(false), None, "nothing new to show");
        let out = l.feed(b"ok\nnext\n").unwrap();
        assert!(out.continues, "the rest of the line has no second prefix");
        assert_eq!(out.bytes, b"ok\n[w0]:next\n");
    }

    #[test]
    fn a_line_longer_than_the_bound_is_split_and_memory_stays_bounded() {
        let mut l = lines();
        let big = vec![b'x'; 3 * MAX_LINE + 10];
        let out = l.feed(&big).unwrap();
        assert_eq!(out.count, 3);
        assert!(out.open);
        assert_eq!(out.bytes.len(), 5 + 3 * MAX_LINE);
        assert_eq!(l.pending.len(), 10);
        let out = l.feed(b"\n").unwrap();
        assert!(out.continues);
        assert_eq!(out.bytes, [vec![b'x'; 10], b"\n".to_vec()].concat());
    }

    #[test]
    fn an_open_line_at_the_end_is_closed_with_a_newline() {
        let mut l = lines();
        l.feed(b"abc");
        l.flush(false).unwrap();
        let out = l.flush(true).unwrap();
        assert!(out.continues);
        assert_eq!(out.bytes, b"\n");
        assert_eq!(l.flush(true), None);
    }

    #[test]
    fn crlf_is_one_line_ending_even_cut_between_chunks() {
        let mut l = lines();
        let out = l.feed(b"a\r\nb\r").unwrap();
        // `b` shows at once, its `\r` waits for the next byte.
        assert_eq!(out.bytes, b"[w0]:a\r\n[w0]:b");
        assert_eq!(l.flush(false), None);
        let out = l.feed(b"\nc\r").unwrap();
        assert!(out.continues);
        assert_eq!(out.bytes, b"\r\n[w0]:c");
        // Not followed by `\n`: a progress update of its own.
        let out = l.feed(b"d\n").unwrap();
        assert_eq!(out.bytes, b"\r[w0]:d\n");
        // At the end, a held `\r` ends its line.
        assert_eq!(l.feed(b"e\r").unwrap().bytes, b"[w0]:e");
        assert_eq!(l.flush(true).unwrap().bytes, b"\r");
    }

    proptest! {
        /// Whatever the chunking and flushes, the console shows every byte, in
        /// order, each line starting with one prefix.
        #[test]
        fn output_is_the_input_with_one_prefix_per_line(
            data in proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'\r'), Just(b'a'), Just(b'b')], 0..400),
            cuts in proptest::collection::vec((0usize..400, any::<bool>()), 0..20),
        ) {
            let mut l = lines();
            let mut shown = Vec::new();
            let mut open = false;
            let mut take = |out: Option<Out>, shown: &mut Vec<u8>| {
                if let Some(o) = out {
                    prop_assert_eq!(o.continues, open);
                    shown.extend_from_slice(&o.bytes);
                    open = o.open;
                }
                Ok(())
            };
            let mut pos = 0;
            let mut cuts = cuts;
            cuts.sort();
            for (cut, flush) in cuts {
                let cut = cut.min(data.len()).max(pos);
                take(l.feed(&data[pos..cut]), &mut shown)?;
                if flush {
                    take(l.flush(false), &mut shown)?;
                }
                pos = cut;
            }
            take(l.feed(&data[pos..]), &mut shown)?;
            take(l.flush(true), &mut shown)?;
            // Expected: the data, a prefix at the start of every line.
            let mut want = Vec::new();
            let mut at_start = true;
            for (i, &b) in data.iter().enumerate() {
                if at_start {
                    want.extend_from_slice(b"[w0]:");
                }
                want.push(b);
                // `\r\n` is one line ending.
                at_start = b == b'\n' || (b == b'\r' && data.get(i + 1) != Some(&b'\n'));
            }
            if !at_start {
                want.push(b'\n');
            }
            prop_assert_eq!(String::from_utf8_lossy(&shown), String::from_utf8_lossy(&want));
        }
    }
}
