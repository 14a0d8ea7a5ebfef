//! TOML configuration files (the run config, AMP policies): parsed by serde derive over the
//! `toml` crate, with every error tied to its place in the file.
//!
//! - Bad TOML (a duplicate key, an unquoted string) is an [`Error::ConfigSyntax`] with the line
//!   and column.
//! - A key that is unknown, of the wrong type, or refused by the caller's checks is an
//!   [`Error::Config`] naming the file, the line and column, the key (`optimizer.lr`), the value
//!   as the file spells it and what the key allows.
//!
//! The owner of a configuration type keeps one description per key (what it allows), used both
//! for serde's type errors ([`ConfigText::deserialize`]) and for its own range checks, which
//! [`ConfigText::locate`] ties to the file.

use std::ops::Range;

use serde::de::DeserializeOwned;
use toml::de::{DeTable, DeValue};
use toml::Spanned;

use crate::base::error::{Error, Location, Result};

/// A configuration file's text, parsed once for the places of its keys.
pub(crate) struct ConfigText<'a> {
    file: &'a str,
    text: &'a str,
    root: Spanned<DeTable<'a>>,
}

impl<'a> ConfigText<'a> {
    /// Parses `text` (`file` names it in errors); a syntax error is an [`Error::ConfigSyntax`].
    pub fn parse(text: &'a str, file: &'a str) -> Result<Self> {
        let root = DeTable::parse(text).map_err(|e| {
            let at = e.span().map(|s| location(text, s.start));
            // The parser's message names no key; the text at the error does ("duplicate key").
            let near = e
                .span()
                .and_then(|s| text.get(s))
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| format!(" (at `{}`)", shorten(s)))
                .unwrap_or_default();
            Error::ConfigSyntax {
                file: file.to_string(),
                at,
                detail: format!("{}{near}", e.message()),
            }
        })?;
        Ok(ConfigText { file, text, root })
    }

    /// Deserializes the document into `T` (serde derive: unknown keys and wrong types are
    /// errors). `allowed(key)` says what a key admits, in the words of the caller's own checks;
    /// keys it does not know keep serde's words.
    pub fn deserialize<T: DeserializeOwned>(
        &self,
        allowed: impl Fn(&str) -> Option<String>,
    ) -> Result<T> {
        toml::from_str(self.text).map_err(|e| self.serde_error(&e, &allowed))
    }

    /// Ties an [`Error::Config`] about a key of this file to the file: its line and column, and
    /// the value as the file spells it. Other errors, and keys the file does not set (a default
    /// that disagrees with a set key), pass through with the file named.
    pub fn locate(&self, e: Error) -> Error {
        let Error::Config {
            at,
            key,
            value,
            allowed,
            ..
        } = e
        else {
            return e;
        };
        let (at, value) = match self.find(&key) {
            Some((_, v)) => (Some(location(self.text, v.start)), self.written(v)),
            None => (at, value),
        };
        Error::Config {
            file: self.file.to_string(),
            at,
            key,
            value,
            allowed,
        }
    }

    fn serde_error(&self, e: &toml::de::Error, allowed: &dyn Fn(&str) -> Option<String>) -> Error {
        let msg = e.message();
        let span = e.span();
        // The innermost key whose name or value holds the error.
        let found = span.as_ref().and_then(|s| self.key_at(s.start));
        if let Some(field) = between(msg, "unknown field `", "`") {
            let (key, value) = match found {
                Some((k, _, v)) => (k, self.written(v)),
                None => (field.to_string(), String::new()),
            };
            let known = msg.split_once("expected ").map_or("", |(_, rest)| rest);
            return Error::Config {
                file: self.file.to_string(),
                at: span.map(|s| location(self.text, s.start)),
                key,
                value,
                allowed: format!("not a known key; expected {known}"),
            };
        }
        if let Some(field) = between(msg, "missing field `", "`") {
            // serde points at the table that lacks the key.
            let table = span.and_then(|s| self.table_spanning(s));
            let key = table.map_or(field.to_string(), |t| format!("{t}.{field}"));
            return Error::Config {
                file: self.file.to_string(),
                at: None,
                allowed: allowed(&key).unwrap_or_else(|| "a value (the key is required)".into()),
                key,
                value: "(missing)".into(),
            };
        }
        match found {
            Some((key, _, v)) => Error::Config {
                file: self.file.to_string(),
                at: Some(location(self.text, v.start)),
                value: self.written(v),
                allowed: allowed(&key).unwrap_or_else(|| msg.to_string()),
                key,
            },
            None => Error::Config {
                file: self.file.to_string(),
                at: span.map(|s| location(self.text, s.start)),
                key: "(document)".into(),
                value: String::new(),
                allowed: msg.to_string(),
            },
        }
    }

    /// The value of `key` as the file spells it (shortened when long).
    fn written(&self, span: Range<usize>) -> String {
        self.text
            .get(span)
            .map(|s| shorten(s.trim()))
            .unwrap_or_default()
    }

    /// The name span and value span of `key` (dotted, `optimizer.lr`).
    fn find(&self, key: &str) -> Option<(Range<usize>, Range<usize>)> {
        let mut table = self.root.get_ref();
        let mut parts = key.split('.').peekable();
        while let Some(part) = parts.next() {
            let (k, v) = table.iter().find(|(k, _)| k.get_ref() == part)?;
            if parts.peek().is_none() {
                return Some((k.span(), v.span()));
            }
            match v.get_ref() {
                DeValue::Table(t) => table = t,
                _ => return None,
            }
        }
        None
    }

    /// The dotted name of the (non-root) table whose value is exactly `span`.
    fn table_spanning(&self, span: Range<usize>) -> Option<String> {
        fn walk(table: &DeTable<'_>, prefix: &str, span: &Range<usize>) -> Option<String> {
            table.iter().find_map(|(k, v)| {
                let DeValue::Table(t) = v.get_ref() else {
                    return None;
                };
                let name = if prefix.is_empty() {
                    k.get_ref().to_string()
                } else {
                    format!("{prefix}.{}", k.get_ref())
                };
                if v.span() == *span {
                    Some(name)
                } else {
                    walk(t, &name, span)
                }
            })
        }
        walk(self.root.get_ref(), "", &span)
    }

    /// The dotted key whose name or value holds byte `pos`, innermost first, with its name and
    /// value spans.
    fn key_at(&self, pos: usize) -> Option<(String, Range<usize>, Range<usize>)> {
        fn walk(
            table: &DeTable<'_>,
            prefix: &str,
            pos: usize,
        ) -> Option<(String, Range<usize>, Range<usize>)> {
            for (k, v) in table.iter() {
                let name = if prefix.is_empty() {
                    k.get_ref().to_string()
                } else {
                    format!("{prefix}.{}", k.get_ref())
                };
                if let DeValue::Table(t) = v.get_ref() {
                    if let Some(inner) = walk(t, &name, pos) {
                        return Some(inner);
                    }
                }
                if k.span().contains(&pos) || v.span().contains(&pos) {
                    return Some((name, k.span(), v.span()));
                }
            }
            None
        }
        walk(self.root.get_ref(), "", pos)
    }
}

/// 1-based line and column (in characters) of byte `pos` of `text`.
fn location(text: &str, pos: usize) -> Location {
    let pos = pos.min(text.len());
    let before = text.get(..pos).unwrap_or(text);
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let clamp = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    Location {
        line: clamp(before.matches('\n').count() + 1),
        column: clamp(before[line_start..].chars().count() + 1),
    }
}

/// What lies between `open` and the next `close` in `s`.
fn between<'s>(s: &'s str, open: &str, close: &str) -> Option<&'s str> {
    let rest = &s[s.find(open)? + open.len()..];
    Some(&rest[..rest.find(close)?])
}

fn shorten(s: &str) -> String {
    const MAX: usize = 60;
    let first_line = s.lines().next().unwrap_or("");
    if first_line.chars().count() > MAX || first_line.len() < s.len() {
        let cut: String = first_line.chars().take(MAX).collect();
        format!("{cut}…")
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_are_one_based_in_characters() {
        let t = "a = 1\nbé = 2\n";
        assert_eq!(location(t, 0), Location { line: 1, column: 1 });
        assert_eq!(location(t, 6), Location { line: 2, column: 1 });
        // The space after the two-byte é is the third character of its line.
        assert_eq!(location(t, 9), Location { line: 2, column: 3 });
    }
}
