//! Client-chosen text on its way into a log line or an audit record: escaped and bounded.
//!
//! Everything a client chooses (method names, JWT subjects, client names, thread ids it sends)
//! goes through [`Untrusted`] before a log line or an audit record holds it:
//!
//! - **Bounded.** At most [`Untrusted::limit`] bytes of it are kept (cut at a character
//!   boundary); a cut value ends in [`CUT_MARKER`] and the number of bytes left out, so a reader
//!   sees that it was cut and by how much. An 8 MiB method name costs a log line of about
//!   [`METHOD_BYTES`] bytes, not 8 MiB.
//! - **Escaped, in logs.** Its `Display` (what `%field` in a `tracing` macro uses) writes every
//!   control character (C0, DEL, C1: newlines, carriage returns, escape sequences), the Unicode
//!   line and paragraph separators and the bidirectional overrides as `\u{..}`, and a backslash
//!   as `\\`, so the text can neither start a new line, nor move the cursor, nor pass for an
//!   escape it did not write. Printable non-ASCII (`José`) is kept as it is.
//! - **JSON-escaped, in audit records.** [`Untrusted::json`] is the bounded text as a JSON
//!   string value; `serde_json` escapes it when the record is written.

use std::fmt;

/// Bytes of a method name kept in logs and audit records.
pub const METHOD_BYTES: usize = 128;
/// Bytes of any other client-chosen text kept (subjects are at most
/// [`crate::credentials::MAX_SUBJECT_BYTES`] already, so they are never cut).
pub const TEXT_BYTES: usize = 256;
/// Bytes of a client-chosen JSON array or object kept in an audit record.
pub const VALUE_BYTES: usize = 1024;
/// What a cut value ends with, followed by the number of bytes left out and `]`.
pub const CUT_MARKER: &str = "…[cut ";

/// A client-chosen string, as logs and audit records may hold it.
#[derive(Clone, Copy)]
pub struct Untrusted<'a> {
    text: &'a str,
    limit: usize,
}

impl<'a> Untrusted<'a> {
    /// A method name: kept to [`METHOD_BYTES`].
    pub fn method(text: &'a str) -> Untrusted<'a> {
        Untrusted {
            text,
            limit: METHOD_BYTES,
        }
    }

    /// Any other client-chosen text (subjects, client names, thread ids): kept to
    /// [`TEXT_BYTES`].
    pub fn text(text: &'a str) -> Untrusted<'a> {
        Untrusted {
            text,
            limit: TEXT_BYTES,
        }
    }

    /// The most bytes of the text kept.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The kept part and the number of bytes cut off.
    fn kept(&self) -> (&'a str, usize) {
        if self.text.len() <= self.limit {
            return (self.text, 0);
        }
        let mut end = self.limit;
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        (&self.text[..end], self.text.len() - end)
    }

    /// The bounded text (not escaped: for a JSON value, which `serde_json` escapes).
    pub fn bounded(&self) -> String {
        match self.kept() {
            (kept, 0) => kept.to_owned(),
            (kept, cut) => format!("{kept}{CUT_MARKER}{cut} bytes]"),
        }
    }

    /// The bounded text as a JSON string value, for an audit record.
    pub fn json(&self) -> serde_json::Value {
        serde_json::Value::String(self.bounded())
    }

    /// A client-chosen JSON value (a client name, an approval decision) for an audit record:
    /// a string bounded like [`Untrusted::text`], `null`, booleans and numbers as they are, and an
    /// array or object as it is when its JSON is at most [`VALUE_BYTES`], else as that JSON cut
    /// to a bounded string.
    pub fn value(v: &serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match v {
            Value::String(s) => Untrusted::text(s).json(),
            Value::Array(_) | Value::Object(_) => {
                let text = v.to_string();
                if text.len() <= VALUE_BYTES {
                    v.clone()
                } else {
                    Untrusted {
                        text: &text,
                        limit: VALUE_BYTES,
                    }
                    .json()
                }
            }
            other => other.clone(),
        }
    }
}

/// Characters written escaped in logs: they could end a line, move the cursor or reorder what
/// a reader sees.
fn needs_escape(c: char) -> bool {
    c.is_control()
        || c == '\\'
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}')
        || ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

impl fmt::Display for Untrusted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kept, cut) = self.kept();
        let mut rest = kept;
        while let Some(at) = rest.find(needs_escape) {
            f.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().unwrap_or_default();
            if c == '\\' {
                f.write_str("\\\\")?;
            } else {
                write!(f, "\\u{{{:x}}}", u32::from(c))?;
            }
            rest = &rest[at + c.len_utf8()..];
        }
        f.write_str(rest)?;
        if cut > 0 {
            write!(f, "{CUT_MARKER}{cut} bytes]")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Untrusted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

/// Escapes the control characters of one formatted log event (`text` format) so that it stays
/// one line: every control character but the final newline (and, when `ansi`, the escape
/// character of the formatter's own colours) is written as `\u{..}`. A backstop behind
/// [`Untrusted`]: whatever a value's `Display` holds (an error quoting its input, a worker's
/// line), one event is one line.
pub fn one_line(event: &str, ansi: bool) -> std::borrow::Cow<'_, str> {
    let body = event.strip_suffix('\n').unwrap_or(event);
    let keep = |c: char| !c.is_control() || (ansi && c == '\u{1b}') || c == '\t';
    if body.chars().all(keep) {
        return std::borrow::Cow::Borrowed(event);
    }
    let mut out = String::with_capacity(event.len() + 16);
    for c in body.chars() {
        if keep(c) {
            out.push(c);
        } else {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        }
    }
    if body.len() < event.len() {
        out.push('\n');
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_long_text_is_cut_with_a_marker() {
        let forged = "x\n{\"ts_ms\":1,\"event\":\"approval.answered\"}\r\u{1b}[2J\u{2028}\\n";
        let shown = Untrusted::method(forged).to_string();
        assert!(!shown.chars().any(char::is_control), "{shown}");
        assert!(shown.starts_with("x\\u{a}{\"ts_ms\""), "{shown}");
        assert!(shown.ends_with("\\u{2028}\\\\n"), "{shown}");
        assert_eq!(Untrusted::text("José").to_string(), "José");

        let long = "é".repeat(4 << 20);
        let shown = Untrusted::method(&long).to_string();
        assert!(shown.len() < METHOD_BYTES + 40, "{}", shown.len());
        assert!(shown.ends_with(&format!("{CUT_MARKER}{} bytes]", long.len() - 128)));
        let json = Untrusted::method(&long).json();
        assert!(json.as_str().is_some_and(|s| s.starts_with("éé")
            && s.len() < METHOD_BYTES + 40
            && s.contains(CUT_MARKER)));
        // At a character boundary: 127 bytes of two-byte characters is 63 of them.
        let odd = format!("a{}", "é".repeat(100));
        assert!(Untrusted::method(&odd).bounded().starts_with(&odd[..127]));
        assert_eq!(Untrusted::text("short").bounded(), "short");
    }

    #[test]
    fn json_values_are_bounded() {
        use serde_json::json;
        assert_eq!(Untrusted::value(&json!("accept")), json!("accept"));
        assert_eq!(Untrusted::value(&json!({"a": [1]})), json!({"a": [1]}));
        assert_eq!(Untrusted::value(&json!(null)), json!(null));
        let big = json!({ "decision": "x".repeat(1 << 20) });
        let kept = Untrusted::value(&big);
        assert!(kept
            .as_str()
            .is_some_and(|s| s.len() < VALUE_BYTES + 40 && s.contains(CUT_MARKER)));
    }

    #[test]
    fn one_event_stays_one_line() {
        assert_eq!(one_line("a b\n", false), "a b\n");
        assert_eq!(one_line("a\nb\r\u{1b}\n", false), "a\\u{a}b\\u{d}\\u{1b}\n");
        assert_eq!(
            one_line("\u{1b}[2mx\u{1b}[0m\n", true),
            "\u{1b}[2mx\u{1b}[0m\n"
        );
    }
}
