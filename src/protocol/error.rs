//! Errors of the side-channel codec.

use std::fmt;

use super::messages::MessageType;

/// Where in a frame a problem was found, for error messages: the message
/// type (if already known) and the field (if any), e.g. `AllocRequest.keys[2]`.
struct At<'a>(&'a Option<MessageType>, &'a Option<String>);

impl fmt::Display for At<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(t) => write!(f, "{t}")?,
            None => f.write_str("<message of unknown type>")?,
        }
        match self.1 {
            Some(field) => write!(f, ".{field}"),
            None => Ok(()),
        }
    }
}

/// Why a side-channel frame could not be decoded.
///
/// Every variant that concerns a particular message or field names it in
/// its `Display` output as `Type.field` (with `[i]` for an array element),
/// or `<message of unknown type>` when the `"type"` key had not been seen
/// yet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The frame has no bytes at all.
    #[error("empty side-channel frame: expected a msgpack map")]
    EmptyFrame,

    /// The top-level value is not a msgpack map.
    #[error("side-channel frame is not a msgpack map: top-level value is {found}")]
    NotAMap {
        /// The msgpack kind found instead (`"array"`, `"int"`, ...).
        found: &'static str,
    },

    /// The frame ends in the middle of a value, or a length announced by
    /// the frame is larger than the bytes left.
    #[error(
        "{}: frame truncated (or a length exceeds the remaining input)",
        At(msg_type, field)
    )]
    Truncated {
        /// Message type, if the `"type"` key had been read already.
        msg_type: Option<MessageType>,
        /// Field being read, if the problem is inside a field (unknown
        /// keys are named too, shortened to at most 64 bytes).
        field: Option<String>,
    },

    /// Bytes follow the complete top-level map.
    #[error("{}: {count} trailing byte(s) after the message map", At(msg_type, &None))]
    TrailingBytes {
        /// Message type, if known.
        msg_type: Option<MessageType>,
        /// How many bytes follow the map.
        count: usize,
    },

    /// A map key is not a msgpack str.
    #[error("{}: map key is {found}, expected str", At(msg_type, &None))]
    NonStringKey {
        /// Message type, if known.
        msg_type: Option<MessageType>,
        /// The msgpack kind of the key.
        found: &'static str,
    },

    /// The map has no `"type"` key.
    #[error("side-channel frame has no \"type\" key")]
    MissingType,

    /// The `"type"` value is not a msgpack str.
    #[error("side-channel frame: \"type\" must be a str, found {found}")]
    InvalidTypeTag {
        /// The msgpack kind found instead.
        found: &'static str,
    },

    /// The `"type"` value names no known message.
    #[error("unknown side-channel message type {name:?}")]
    UnknownType {
        /// The type name as received (shortened to at most 64 bytes).
        name: String,
    },

    /// A required field is absent.
    #[error("{msg_type}.{field}: required field is missing")]
    MissingField {
        /// Message type.
        msg_type: MessageType,
        /// Field name.
        field: &'static str,
    },

    /// A field (or `"type"`) occurs more than once in the map.
    #[error("{msg_type}.{field}: key appears more than once")]
    DuplicateField {
        /// Message type.
        msg_type: MessageType,
        /// Field name.
        field: &'static str,
    },

    /// A field holds a value of the wrong msgpack kind.
    #[error("{msg_type}.{field}: expected {expected}, found {found}")]
    WrongType {
        /// Message type.
        msg_type: MessageType,
        /// Field name, with `[i]` when an array element is wrong.
        field: String,
        /// What the field requires (`"int"`, `"str"`, `"array"`, `"bool"`).
        expected: &'static str,
        /// The msgpack kind found.
        found: &'static str,
    },

    /// An integer field holds a value outside its range (e.g. a negative
    /// index).
    #[error("{msg_type}.{field}: value {value} out of range, expected {expected}")]
    OutOfRange {
        /// Message type.
        msg_type: MessageType,
        /// Field name, with `[i]` for an array element.
        field: String,
        /// The value received.
        value: i128,
        /// The accepted range, in words.
        expected: &'static str,
    },

    /// A msgpack str (field value or map key) is not valid UTF-8.
    #[error("{}: string is not valid UTF-8", At(msg_type, field))]
    InvalidUtf8 {
        /// Message type, if known.
        msg_type: Option<MessageType>,
        /// Field name (with `[i]` for an array element); `None` for a map key.
        field: Option<String>,
    },

    /// The frame contains the byte `0xc1`, which msgpack never uses.
    #[error("{}: reserved msgpack byte 0xc1", At(msg_type, field))]
    ReservedByte {
        /// Message type, if known.
        msg_type: Option<MessageType>,
        /// Field (or unknown key) in which it was found, if any.
        field: Option<String>,
    },

    /// The frame is a valid message, but not of the type the caller asked
    /// for (from the typed `decode` functions such as
    /// [`AllocRequest::decode`](super::AllocRequest::decode)).
    #[error("expected a {expected} message, received {found}")]
    UnexpectedMessage {
        /// The type the caller expected.
        expected: MessageType,
        /// The type that was received.
        found: MessageType,
    },
}

/// Why a message could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// A string or array is longer than msgpack's 32-bit length allows.
    #[error("{msg_type}.{field}: length {len} exceeds the msgpack limit of 2^32-1")]
    TooLong {
        /// Message type.
        msg_type: MessageType,
        /// Field name.
        field: &'static str,
        /// The offending length (bytes for a str, elements for an array).
        len: usize,
    },
}

/// Shorten an untrusted string for inclusion in an error (at most 64 bytes,
/// cut on a char boundary, with an ellipsis when cut).
pub(crate) fn shorten(s: &str) -> String {
    const MAX: usize = 64;
    if s.len() <= MAX {
        return s.to_owned();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}
