//! (being written: issue 47)
