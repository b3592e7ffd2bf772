//! The types of earlier data formats, frozen as they were encoded, with their
//! conversions to and from today's. One module per format still read (see
//! [`crate::format`]); a format's module goes when no supported store or
//! cluster can hold it any more.

pub mod v4;
