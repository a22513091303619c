//! Reading request traces (`TIMESTAMP,ContextTokens,GeneratedTokens`).
//!
//! A trace is a CSV file with a header, split into fields by the `csv` crate: a field in double
//! quotes may hold commas, line breaks and quotes written twice (`"say ""hi"", then go"`), as
//! spreadsheets export them. The three columns are found by name (case-insensitive, in any
//! order; other columns are ignored), so the Azure LLM inference traces and any file a user
//! exports in the same schema read alike. `TIMESTAMP` is `YYYY-MM-DD HH:MM:SS` with an optional
//! fraction of up to nine digits (a `T` may replace the space); it is read as a wall clock
//! without a time zone, and only differences between rows matter. Fields may be padded with
//! spaces, also around their quotes (` "12" ` reads as `12`).
//!
//! The reader is strict where a mistake would silently skew a simulation (a bad number, an
//! impossible date, an absurd token count, a quote left open that would swallow the rows after
//! it) and lenient about layout (CRLF, a UTF-8 BOM, blank lines, a missing final newline, rows
//! out of time order). Every error names the file, the 1-based line (where the row starts) and
//! the field, so a user can fix their trace without reading this code.

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// Longest line accepted, in bytes (without the line ending). Checked before the CSV reader
/// runs, so a hostile file without line breaks is refused without buffering it as one row.
pub const MAX_LINE_BYTES: usize = 4096;
/// Largest trace file accepted, in bytes (1 GiB).
pub const MAX_FILE_BYTES: u64 = 1 << 30;
/// Largest prompt or output token count accepted in one request; more is a broken trace.
pub const MAX_TOKENS: u32 = 10_000_000;

/// Longest field value quoted back in an error message, in characters.
const MAX_QUOTED_CHARS: usize = 80;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRow {
    /// Arrival time in milliseconds after the trace's earliest timestamp.
    pub offset_ms: f64,
    /// Prompt tokens (`ContextTokens`).
    pub prompt_tokens: u32,
    /// Output tokens (`GeneratedTokens`).
    pub output_tokens: u32,
    /// The row's 1-based line in the file, for messages that point back at it.
    pub line: usize,
}

/// A whole trace, ready to replay.
#[derive(Clone, Debug)]
pub struct Trace {
    /// Requests sorted by `offset_ms`; rows with equal timestamps keep their file order.
    pub rows: Vec<TraceRow>,
    /// Offset of the last request (0 for a single row).
    pub span_ms: f64,
}

/// A column the reader needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Column {
    /// `TIMESTAMP`: when the request arrived.
    Timestamp,
    /// `ContextTokens`: prompt tokens.
    ContextTokens,
    /// `GeneratedTokens`: output tokens.
    GeneratedTokens,
}

impl Column {
    /// Every required column, in the schema's order.
    pub const ALL: [Column; 3] = [
        Column::Timestamp,
        Column::ContextTokens,
        Column::GeneratedTokens,
    ];

    /// The column's name as the schema spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Column::Timestamp => "TIMESTAMP",
            Column::ContextTokens => "ContextTokens",
            Column::GeneratedTokens => "GeneratedTokens",
        }
    }
}

impl fmt::Display for Column {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What is wrong with a field's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FieldProblem {
    /// A token count with a sign, a decimal point or anything but digits.
    #[error("not a non-negative integer")]
    NotAnInteger,
    /// A token count above [`MAX_TOKENS`] (including ones too large for any integer type).
    #[error("over the limit of {} tokens", MAX_TOKENS)]
    TooManyTokens,
    /// A timestamp that does not parse or names an impossible date or time.
    #[error("not a timestamp YYYY-MM-DD HH:MM:SS[.fffffffff] ({0})")]
    BadTimestamp(&'static str),
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("{file}: cannot read trace: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    /// The file is over [`MAX_FILE_BYTES`].
    #[error("{file}: trace is larger than the limit of {limit} bytes")]
    FileTooLarge { file: String, limit: u64 },
    /// The bytes are not UTF-8 (first bad byte on `line`).
    #[error("{file}:{line}: not valid UTF-8")]
    NotUtf8 { file: String, line: usize },
    /// Nothing but blank lines (or nothing at all).
    #[error(
        "{file}:1: empty trace: expected a header naming the fields TIMESTAMP, ContextTokens \
         and GeneratedTokens"
    )]
    Empty { file: String },
    /// A line is over [`MAX_LINE_BYTES`].
    #[error("{file}:{line}: line is longer than the limit of {limit} bytes")]
    LineTooLong {
        file: String,
        line: usize,
        limit: usize,
    },
    /// The header lacks a required column.
    #[error("{file}:{line}: header has no field {column} (found: {found})")]
    MissingColumn {
        file: String,
        line: usize,
        column: Column,
        found: String,
    },
    /// The header names a required column twice, so which one to read is ambiguous.
    #[error("{file}:{line}: header names field {column} twice")]
    DuplicateColumn {
        file: String,
        line: usize,
        column: Column,
    },
    /// A header and no requests.
    #[error(
        "{file}:{line}: no requests after the header (expected rows of TIMESTAMP, \
         ContextTokens, GeneratedTokens)"
    )]
    NoRows { file: String, line: usize },
    /// A row holds an odd number of double quotes: a quoted field left open (it would run on
    /// over the rows after it) or a stray quote inside an unquoted field.
    #[error(
        "{file}:{line}: unbalanced double quote: a quoted field must be closed, and a quote \
         inside it written twice (\"\")"
    )]
    UnbalancedQuote { file: String, line: usize },
    /// The CSV reader refused the input (not expected for text that is valid UTF-8; kept
    /// rather than unwrapped).
    #[error("{file}:{line}: cannot read CSV: {message}")]
    Csv {
        file: String,
        line: usize,
        message: String,
    },
    /// A row ends before a required column.
    #[error("{file}:{line}: field {column}: missing (the row has {found} fields)")]
    MissingField {
        file: String,
        line: usize,
        column: Column,
        found: usize,
    },
    /// A required field is blank.
    #[error("{file}:{line}: field {column}: empty")]
    EmptyField {
        file: String,
        line: usize,
        column: Column,
    },
    /// A required field has a value that does not parse or is out of range.
    #[error("{file}:{line}: field {column}: {problem}: {value:?}")]
    Field {
        file: String,
        line: usize,
        column: Column,
        problem: FieldProblem,
        /// The offending value, shortened to a readable length.
        value: String,
    },
}

/// Reads and parses the trace at `path`; messages name the file as `path` displays.
pub fn read_trace(path: &Path) -> Result<Trace, TraceError> {
    let name = path.display().to_string();
    let io = |source| TraceError::Io {
        file: name.clone(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    // Refuse a huge file before reading any of it; `take` guards against a file that grows
    // (or a special file whose metadata says nothing about its length).
    check_size(&name, file.metadata().map_err(io)?.len())?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    check_size(&name, bytes.len() as u64)?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let bad = e.utf8_error().valid_up_to();
        let line = e.as_bytes()[..bad].iter().filter(|&&b| b == b'\n').count() + 1;
        TraceError::NotUtf8 {
            file: name.clone(),
            line,
        }
    })?;
    parse_trace(&name, &text)
}

/// Parses a trace from `text`; `name` is the file name used in messages.
pub fn parse_trace(name: &str, text: &str) -> Result<Trace, TraceError> {
    check_size(name, text.len() as u64)?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (i, line) in text.split('\n').enumerate() {
        check_line_length(name, i + 1, line.strip_suffix('\r').unwrap_or(line))?;
    }
    let mut rows = Rows::new(name, text);

    // The header is the first non-blank row.
    let Some((header_line, header)) = rows.next_row()? else {
        return Err(TraceError::Empty {
            file: name.to_owned(),
        });
    };
    let columns = find_columns(name, header_line, &header)?;

    let mut parsed: Vec<(i128, TraceRow)> = Vec::new();
    while let Some((n, fields)) = rows.next_row()? {
        let mut values = [""; 3];
        for (value, (column, index)) in values.iter_mut().zip(Column::ALL.into_iter().zip(columns))
        {
            *value = match fields.get(index).copied() {
                None => {
                    return Err(TraceError::MissingField {
                        file: name.to_owned(),
                        line: n,
                        column,
                        found: fields.len(),
                    })
                }
                Some("") => {
                    return Err(TraceError::EmptyField {
                        file: name.to_owned(),
                        line: n,
                        column,
                    })
                }
                Some(v) => v,
            };
        }
        let field_error = |column: Column, problem: FieldProblem, value: &str| TraceError::Field {
            file: name.to_owned(),
            line: n,
            column,
            problem,
            value: shorten(value),
        };
        let [timestamp, prompt, output] = values;
        let at =
            parse_timestamp(timestamp).map_err(|p| field_error(Column::Timestamp, p, timestamp))?;
        let prompt_tokens =
            parse_tokens(prompt).map_err(|p| field_error(Column::ContextTokens, p, prompt))?;
        let output_tokens =
            parse_tokens(output).map_err(|p| field_error(Column::GeneratedTokens, p, output))?;
        parsed.push((
            at,
            TraceRow {
                offset_ms: 0.0,
                prompt_tokens,
                output_tokens,
                line: n,
            },
        ));
    }

    // Out-of-order rows are allowed: a stable sort keeps same-instant rows in file order.
    parsed.sort_by_key(|&(at, _)| at);
    let Some(&(start, _)) = parsed.first() else {
        return Err(TraceError::NoRows {
            file: name.to_owned(),
            line: header_line,
        });
    };
    let rows: Vec<TraceRow> = parsed
        .into_iter()
        .map(|(at, row)| TraceRow {
            offset_ms: (at - start) as f64 / 1e6,
            ..row
        })
        .collect();
    let span_ms = rows.last().map_or(0.0, |r| r.offset_ms);
    Ok(Trace { rows, span_ms })
}

/// The rows of a trace as the `csv` crate splits them, blank lines left out, each with the
/// line it starts on.
struct Rows<'a> {
    name: &'a str,
    text: &'a str,
    reader: csv::Reader<&'a [u8]>,
    record: csv::StringRecord,
    /// Line breaks counted so far: `line` is the 1-based line of byte `counted_to`.
    line: usize,
    counted_to: usize,
}

impl<'a> Rows<'a> {
    fn new(name: &'a str, text: &'a str) -> Rows<'a> {
        let reader = csv::ReaderBuilder::new()
            // The header is read as a row: it is the first non-blank one, found here.
            .has_headers(false)
            // Rows may stop short of trailing extra columns or carry more than the header.
            .flexible(true)
            .from_reader(text.as_bytes());
        Rows {
            name,
            text,
            reader,
            record: csv::StringRecord::new(),
            line: 1,
            counted_to: 0,
        }
    }

    /// The next row that is not blank: its first line and its fields, each without padding
    /// spaces or one pair of enclosing quotes the reader left on it.
    fn next_row(&mut self) -> Result<Option<(usize, Vec<&str>)>, TraceError> {
        loop {
            let start = self.reader.position().byte() as usize;
            let line = self.line_of(start);
            match self.reader.read_record(&mut self.record) {
                Ok(true) => {}
                Ok(false) => return Ok(None),
                Err(e) => {
                    return Err(TraceError::Csv {
                        file: self.name.to_owned(),
                        line,
                        message: e.to_string(),
                    })
                }
            }
            // The csv crate closes a quote left open at the end of the input and takes a
            // stray quote literally; either leaves an odd count in the row's raw text, and
            // either would otherwise read as something the file does not say.
            let end = self.reader.position().byte() as usize;
            let raw = self.text.as_bytes().get(start..end).unwrap_or_default();
            if raw.iter().filter(|&&b| b == b'"').count() % 2 == 1 {
                return Err(TraceError::UnbalancedQuote {
                    file: self.name.to_owned(),
                    line,
                });
            }
            // A line of spaces is a row of one blank field; empty lines the reader skips.
            let blank = self.record.len() == 1 && self.record.iter().all(|f| f.trim().is_empty());
            if !blank {
                return Ok(Some((line, self.record.iter().map(clean).collect())));
            }
        }
    }

    /// The 1-based line on which a row read from byte `start` begins. The reader's own
    /// position sits before the line ending of the previous row and any blank lines, so
    /// those are skipped first; rows come in order, so the count goes on from the last call.
    fn line_of(&mut self, start: usize) -> usize {
        let bytes = self.text.as_bytes();
        let mut at = start.min(bytes.len());
        while matches!(bytes.get(at), Some(b'\r' | b'\n')) {
            at += 1;
        }
        let from = self.counted_to.min(at);
        self.line += bytes[from..at].iter().filter(|&&b| b == b'\n').count();
        self.counted_to = at;
        self.line
    }
}

fn check_size(name: &str, len: u64) -> Result<(), TraceError> {
    if len > MAX_FILE_BYTES {
        return Err(TraceError::FileTooLarge {
            file: name.to_owned(),
            limit: MAX_FILE_BYTES,
        });
    }
    Ok(())
}

fn check_line_length(name: &str, line: usize, text: &str) -> Result<(), TraceError> {
    if text.len() > MAX_LINE_BYTES {
        return Err(TraceError::LineTooLong {
            file: name.to_owned(),
            line,
            limit: MAX_LINE_BYTES,
        });
    }
    Ok(())
}

/// The index of each required column (in [`Column::ALL`] order) in the header.
fn find_columns(name: &str, line: usize, names: &[&str]) -> Result<[usize; 3], TraceError> {
    let mut indexes = [0; 3];
    for (slot, column) in indexes.iter_mut().zip(Column::ALL) {
        let mut matches = names
            .iter()
            .enumerate()
            .filter(|(_, n)| n.eq_ignore_ascii_case(column.as_str()))
            .map(|(i, _)| i);
        *slot = matches.next().ok_or_else(|| TraceError::MissingColumn {
            file: name.to_owned(),
            line,
            column,
            found: shorten(&names.join(", ")),
        })?;
        if matches.next().is_some() {
            return Err(TraceError::DuplicateColumn {
                file: name.to_owned(),
                line,
                column,
            });
        }
    }
    Ok(indexes)
}

/// A field without surrounding spaces or one pair of enclosing double quotes. The csv crate
/// unquotes a field only when the quote is its first byte, so ` "12" ` reaches here quoted.
fn clean(field: &str) -> &str {
    let field = field.trim();
    field
        .strip_prefix('"')
        .and_then(|f| f.strip_suffix('"'))
        .map_or(field, str::trim)
}

/// `value`, cut to [`MAX_QUOTED_CHARS`] characters for an error message.
fn shorten(value: &str) -> String {
    match value.char_indices().nth(MAX_QUOTED_CHARS) {
        Some((cut, _)) => format!("{}...", &value[..cut]),
        None => value.to_owned(),
    }
}

/// A token count: ASCII digits only, at most [`MAX_TOKENS`].
fn parse_tokens(value: &str) -> Result<u32, FieldProblem> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(FieldProblem::NotAnInteger);
    }
    let mut n: u32 = 0;
    for b in value.bytes() {
        n = n
            .checked_mul(10)
            .and_then(|n| n.checked_add(u32::from(b - b'0')))
            .filter(|&n| n <= MAX_TOKENS)
            .ok_or(FieldProblem::TooManyTokens)?;
    }
    Ok(n)
}

/// Nanoseconds since 1970-01-01 00:00:00 of `YYYY-MM-DD HH:MM:SS[.fffffffff]`.
fn parse_timestamp(value: &str) -> Result<i128, FieldProblem> {
    let bad = FieldProblem::BadTimestamp;
    let b = value.as_bytes();
    if b.len() < 19
        || b[4] != b'-'
        || b[7] != b'-'
        || !(b[10] == b' ' || b[10] == b'T')
        || b[13] != b':'
        || b[16] != b':'
    {
        return Err(bad("expected YYYY-MM-DD HH:MM:SS"));
    }
    let digits = |range: std::ops::Range<usize>| -> Result<u32, FieldProblem> {
        let part = &b[range];
        if !part.iter().all(u8::is_ascii_digit) {
            return Err(bad("expected YYYY-MM-DD HH:MM:SS"));
        }
        Ok(part.iter().fold(0, |n, d| n * 10 + u32::from(d - b'0')))
    };
    let (year, month, day) = (digits(0..4)?, digits(5..7)?, digits(8..10)?);
    let (hour, minute, second) = (digits(11..13)?, digits(14..16)?, digits(17..19)?);
    if !(1..=12).contains(&month) {
        return Err(bad("month out of range 01-12"));
    }
    if !(1..=days_in_month(year, month)).contains(&day) {
        return Err(bad("day out of range for the month"));
    }
    if hour > 23 {
        return Err(bad("hour out of range 00-23"));
    }
    if minute > 59 {
        return Err(bad("minute out of range 00-59"));
    }
    if second > 59 {
        return Err(bad("second out of range 00-59"));
    }
    let mut nanos: u32 = 0;
    if b.len() > 19 {
        let fraction = &b[20..];
        if b[19] != b'.' || fraction.is_empty() || !fraction.iter().all(u8::is_ascii_digit) {
            return Err(bad("expected a fraction of seconds after the seconds"));
        }
        if fraction.len() > 9 {
            return Err(bad("more than 9 fractional digits"));
        }
        let scale = 10u32.pow(9 - fraction.len() as u32);
        nanos = fraction.iter().fold(0, |n, d| n * 10 + u32::from(d - b'0')) * scale;
    }
    let days = days_from_civil(i64::from(year), month, day);
    let seconds =
        days * 86_400 + i64::from(hour) * 3_600 + i64::from(minute) * 60 + i64::from(second);
    Ok(i128::from(seconds) * 1_000_000_000 + i128::from(nanos))
}

fn is_leap_year(year: u32) -> bool {
    // Every fourth year, except centuries not divisible by 400.
    match (year % 4, year % 100, year % 400) {
        (_, _, 0) => true,
        (_, 0, _) => false,
        (0, _, _) => true,
        _ => false,
    }
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        2 if is_leap_year(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    // Count years from March, so the leap day is the last day of the year.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y.rem_euclid(400);
    let month_from_march = i64::from((month + 9) % 12);
    let day_of_year = (153 * month_from_march + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    const HEADER: &str = "TIMESTAMP,ContextTokens,GeneratedTokens\n";

    fn parse(text: &str) -> Trace {
        parse_trace("traces/x.csv", text).unwrap()
    }

    fn error(text: &str) -> String {
        parse_trace("traces/x.csv", text).unwrap_err().to_string()
    }

    /// Asserts that a message names the file, the line and the field.
    fn assert_names(message: &str, line: usize, field: &str) {
        let at = format!("traces/x.csv:{line}:");
        assert!(
            message.starts_with(&at),
            "{message:?} should start with {at:?}"
        );
        assert!(message.contains(field), "{message:?} should name {field}");
    }

    fn scratch(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("slackgate-trace-{}-{name}", std::process::id()))
    }

    #[test]
    fn reads_rows_with_offsets_from_the_first_timestamp() {
        let trace = parse(&format!(
            "{HEADER}2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,3180,8\n\
             2023-11-16 18:17:05,110,27\n"
        ));
        let offsets: Vec<f64> = trace.rows.iter().map(|r| r.offset_ms).collect();
        assert_eq!(offsets, [0.0, 52.0, 1020.04]);
        assert_eq!(trace.span_ms, 1020.04);
        assert_eq!(
            trace.rows[1],
            TraceRow {
                offset_ms: 52.0,
                prompt_tokens: 3180,
                output_tokens: 8,
                line: 3
            }
        );
    }

    #[test]
    fn columns_are_found_by_name_in_any_order() {
        let trace = parse(
            "generatedtokens, Extra ,\"TimeStamp\",contexttokens\n5,x,2023-01-01 00:00:00,7\n",
        );
        assert_eq!(trace.rows.len(), 1);
        assert_eq!(trace.rows[0].prompt_tokens, 7);
        assert_eq!(trace.rows[0].output_tokens, 5);
        assert_eq!(trace.span_ms, 0.0);
        // A row may stop short of trailing extra columns, or carry more fields than the header.
        let trace = parse("TIMESTAMP,ContextTokens,GeneratedTokens,Note\n2023-01-01 00:00:00,1,2\n2023-01-01 00:00:01,3,4,a,b\n");
        assert_eq!(trace.rows.len(), 2);
    }

    #[test]
    fn tolerates_crlf_bom_blank_lines_and_a_missing_final_newline() {
        let text = "\u{feff}\r\nTIMESTAMP,ContextTokens,GeneratedTokens\r\n\r\n2023-01-01 00:00:00,1,2\r\n   \r\n2023-01-01 00:00:00.5,3,4";
        let trace = parse(text);
        assert_eq!(trace.rows.len(), 2);
        assert_eq!(trace.rows[0].line, 4);
        assert_eq!(trace.rows[1].line, 6);
        assert_eq!(trace.span_ms, 500.0);
        assert_eq!(parse(&format!("{text}\n")).rows, trace.rows);
    }

    #[test]
    fn out_of_order_rows_are_sorted_stably_from_the_earliest() {
        let trace = parse(&format!(
            "{HEADER}2023-01-01 00:00:02,1,1\n2023-01-01 00:00:01,2,2\n2023-01-01 00:00:02,3,3\n\
             2023-01-01 00:00:00.25,4,4\n"
        ));
        let got: Vec<(f64, u32, usize)> = trace
            .rows
            .iter()
            .map(|r| (r.offset_ms, r.prompt_tokens, r.line))
            .collect();
        assert_eq!(
            got,
            [(0.0, 4, 5), (750.0, 2, 3), (1750.0, 1, 2), (1750.0, 3, 4)]
        );
        assert_eq!(trace.span_ms, 1750.0);
    }

    #[test]
    fn timestamps_follow_the_calendar() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2023, 11, 16), 19_677);
        assert_eq!(days_from_civil(2024, 2, 29), 19_782);
        assert_eq!(days_from_civil(1, 1, 1), -719_162);
        assert_eq!(days_from_civil(9999, 12, 31), 2_932_896);
        let ns = |s: &str| parse_timestamp(s).unwrap();
        assert_eq!(ns("1970-01-01 00:00:00"), 0);
        assert_eq!(ns("1970-01-01T00:00:01.5"), 1_500_000_000);
        assert_eq!(ns("1970-01-01 00:00:00.000000001"), 1);
        assert_eq!(ns("2023-11-16 18:17:03.9799600"), 1_700_158_623_979_960_000);
        // Across a year end and a leap day.
        assert_eq!(
            ns("2024-01-01 00:00:00.5") - ns("2023-12-31 23:59:59.5"),
            1_000_000_000
        );
        assert_eq!(
            ns("2024-03-01 00:00:00") - ns("2024-02-28 00:00:00"),
            2 * 86_400 * 1_000_000_000
        );
        assert_eq!(
            ns("2000-02-29 12:00:00") - ns("2000-02-28 12:00:00"),
            86_400_000_000_000
        );
    }

    #[test]
    fn the_documented_example_message() {
        let m = error(&format!(
            "{HEADER}{}2023-01-01 00:00:00,abc,1\n",
            "2023-01-01 00:00:00,1,1\n".repeat(15)
        ));
        assert_eq!(
            m,
            "traces/x.csv:17: field ContextTokens: not a non-negative integer: \"abc\""
        );
    }

    #[test]
    fn missing_file_names_the_path() {
        let path = scratch("does-not-exist.csv");
        let m = read_trace(&path).unwrap_err().to_string();
        assert!(m.starts_with(&path.display().to_string()), "{m}");
        assert!(m.contains("cannot read trace"), "{m}");
    }

    #[test]
    fn empty_files_are_refused() {
        for text in ["", "\n\n", "\u{feff}", " \r\n\t\r\n"] {
            let m = error(text);
            assert_names(&m, 1, "TIMESTAMP");
            assert!(m.contains("empty trace"), "{m}");
        }
    }

    #[test]
    fn a_header_without_rows_is_refused() {
        let m = error(&format!("\n{HEADER}\n\n"));
        assert_names(&m, 2, "TIMESTAMP");
        assert!(m.contains("no requests after the header"), "{m}");
    }

    #[test]
    fn a_missing_or_duplicate_column_is_refused() {
        let m = error("TIMESTAMP,ContextTokens,Output\n2023-01-01 00:00:00,1,1\n");
        assert_names(&m, 1, "GeneratedTokens");
        assert!(m.contains("header has no field GeneratedTokens"), "{m}");
        assert!(m.contains("found: TIMESTAMP, ContextTokens, Output"), "{m}");
        let m = error("TIMESTAMP,ContextTokens,GeneratedTokens,contexttokens\n");
        assert_names(&m, 1, "ContextTokens");
        assert!(m.contains("twice"), "{m}");
    }

    #[test]
    fn malformed_timestamps_are_refused() {
        for (value, reason) in [
            ("2023-11-16", "expected YYYY-MM-DD HH:MM:SS"),
            ("yesterday at noon", "expected YYYY-MM-DD HH:MM:SS"),
            ("2023/11/16 12:00:00", "expected YYYY-MM-DD HH:MM:SS"),
            ("2023-11-16 1a:00:00", "expected YYYY-MM-DD HH:MM:SS"),
            ("+023-11-16 12:00:00", "expected YYYY-MM-DD HH:MM:SS"),
            ("2023-13-01 00:00:00", "month"),
            ("2023-00-01 00:00:00", "month"),
            ("2023-11-31 00:00:00", "day"),
            ("2023-02-29 00:00:00", "day"),
            ("1900-02-29 00:00:00", "day"),
            ("2023-11-00 00:00:00", "day"),
            ("2023-11-16 24:00:00", "hour"),
            ("2023-11-16 12:60:00", "minute"),
            ("2023-11-16 12:00:60", "second"),
            ("2023-11-16 12:00:00.", "fraction"),
            ("2023-11-16 12:00:00Z", "fraction"),
            ("2023-11-16 12:00:00.12x", "fraction"),
            ("2023-11-16 12:00:00.1234567890", "more than 9"),
        ] {
            let m = error(&format!("{HEADER}2023-01-01 00:00:00,1,1\n{value},1,1\n"));
            assert_names(&m, 3, "field TIMESTAMP: not a timestamp");
            assert!(m.contains(reason), "{value}: {m}");
            assert!(m.contains(&format!("{value:?}")), "{value}: {m}");
        }
    }

    #[test]
    fn bad_token_counts_are_refused() {
        for (value, problem) in [
            ("-5", "not a non-negative integer"),
            ("1.5", "not a non-negative integer"),
            ("+3", "not a non-negative integer"),
            ("1e3", "not a non-negative integer"),
            ("abc", "not a non-negative integer"),
            ("1 000", "not a non-negative integer"),
            ("10000001", "over the limit of 10000000 tokens"),
            ("4294967296", "over the limit of 10000000 tokens"),
            (
                "99999999999999999999999999",
                "over the limit of 10000000 tokens",
            ),
        ] {
            let m = error(&format!("{HEADER}2023-01-01 00:00:00,{value},1\n"));
            assert_names(&m, 2, &format!("field ContextTokens: {problem}: {value:?}"));
            let m = error(&format!("{HEADER}2023-01-01 00:00:00,1,{value}\n"));
            assert_names(
                &m,
                2,
                &format!("field GeneratedTokens: {problem}: {value:?}"),
            );
        }
        let trace = parse(&format!("{HEADER}2023-01-01 00:00:00, 10000000 ,0\n"));
        assert_eq!(trace.rows[0].prompt_tokens, MAX_TOKENS);
        assert_eq!(trace.rows[0].output_tokens, 0);
    }

    #[test]
    fn short_rows_and_empty_fields_are_refused() {
        let m = error(&format!(
            "{HEADER}2023-01-01 00:00:00,1,1\n2023-01-01 00:00:01,5\n"
        ));
        assert_eq!(
            m,
            "traces/x.csv:3: field GeneratedTokens: missing (the row has 2 fields)"
        );
        let m = error(&format!("{HEADER}2023-01-01 00:00:00,,5\n"));
        assert_eq!(m, "traces/x.csv:2: field ContextTokens: empty");
        let m = error(&format!("{HEADER}\"\",1,5\n"));
        assert_eq!(m, "traces/x.csv:2: field TIMESTAMP: empty");
    }

    #[test]
    fn long_lines_are_refused() {
        let long = "9".repeat(MAX_LINE_BYTES);
        let m = error(&format!(
            "{HEADER}2023-01-01 00:00:00,1,1\n2023-01-01 00:00:00,1,{long}\n"
        ));
        assert_eq!(
            m,
            "traces/x.csv:3: line is longer than the limit of 4096 bytes"
        );
        // A line of exactly the limit is accepted.
        let at_limit = format!("2023-01-01 00:00:00,1,{}", "0".repeat(MAX_LINE_BYTES - 22));
        assert_eq!(at_limit.len(), MAX_LINE_BYTES);
        assert_eq!(parse(&format!("{HEADER}{at_limit}\r\n")).rows.len(), 1);
        // A quoted value is cut short in the message.
        let m = error(&format!(
            "{HEADER}2023-01-01 00:00:00,{},1\n",
            "x".repeat(200)
        ));
        assert!(m.len() < 200, "{m}");
        assert!(m.ends_with("...\""), "{m}");
    }

    #[test]
    fn quoted_fields_may_hold_commas_quotes_and_line_breaks() {
        let trace = parse(concat!(
            "\"Note, free text\",TIMESTAMP,\"ContextTokens\",GeneratedTokens\r\n",
            "\"a, b and \"\"c\"\"\",\"2023-01-01 00:00:00\",\"12\",3\r\n",
            "\"two\r\nlines, \"\"quoted\"\"\",2023-01-01 00:00:01, \"5\" ,6\r\n",
            "\"\",2023-01-01 00:00:02,7,8\r\n",
        ));
        let got: Vec<(f64, u32, u32, usize)> = trace
            .rows
            .iter()
            .map(|r| (r.offset_ms, r.prompt_tokens, r.output_tokens, r.line))
            .collect();
        // The second row spans lines 3 and 4, so the third starts on line 5.
        assert_eq!(got, [(0.0, 12, 3, 2), (1000.0, 5, 6, 3), (2000.0, 7, 8, 5)]);
        // A quoted comma inside a required field is part of the value, not a separator.
        let m = error(&format!("{HEADER}2023-01-01 00:00:00,\"1,000\",5\n"));
        assert_eq!(
            m,
            "traces/x.csv:2: field ContextTokens: not a non-negative integer: \"1,000\""
        );
        // Errors after a row with line breaks name the true line.
        let m = error(&format!(
            "{}2023-01-01 00:00:00,1,1,\"a\n\nb\"\n2023-01-01 00:00:00,x,1\n",
            "TIMESTAMP,ContextTokens,GeneratedTokens,Note\n"
        ));
        assert_eq!(
            m,
            "traces/x.csv:5: field ContextTokens: not a non-negative integer: \"x\""
        );
    }

    #[test]
    fn an_open_or_stray_quote_is_refused_with_its_line() {
        let header = "TIMESTAMP,ContextTokens,GeneratedTokens,Note\n";
        let want = |line: usize| {
            format!(
                "traces/x.csv:{line}: unbalanced double quote: a quoted field must be closed, \
                 and a quote inside it written twice (\"\")"
            )
        };
        // Left open, the note would swallow the two rows after it.
        let m = error(&format!(
            "{header}2023-01-01 00:00:00,1,1,ok\n\n2023-01-01 00:00:01,1,1,\"open\n\
             2023-01-01 00:00:02,1,1,x\n2023-01-01 00:00:03,1,1,y\n"
        ));
        assert_eq!(m, want(4));
        assert_eq!(
            error(&format!("{header}2023-01-01 00:00:00,1,2\"\n")),
            want(2)
        );
        assert_eq!(
            error("TIMESTAMP,\"ContextTokens,GeneratedTokens\n"),
            want(1)
        );
        assert_eq!(
            error(&format!("{HEADER}2023-01-01 00:00:00,1,1\r\n\"2023")),
            want(3)
        );
    }

    #[test]
    fn hostile_input_is_refused_without_panicking() {
        // Only separators, only quotes, very many fields, control bytes, a lone CR.
        for text in [
            ",,,,,,,,\n,,,\n".to_string(),
            "\"".repeat(4000),
            format!("\"{}\"", "\"\"".repeat(2000)),
            format!("{HEADER}{}\n", ",".repeat(4000)),
            format!("{HEADER}2023-01-01 00:00:00,1,1\0\x07\n"),
            format!("{HEADER}2023-01-01 00:00:00,1,1\r2023-01-01 00:00:01,2,2\r"),
            "\r\n\r\n\r\n".to_string(),
        ] {
            let _ = parse_trace("traces/x.csv", &text);
        }
        let m = error(&format!("{HEADER}{}\n", ",".repeat(4000)));
        assert_eq!(m, "traces/x.csv:2: field TIMESTAMP: empty");
        // A whole file on one line is refused by length before the CSV reader buffers it.
        let m = error(&format!("{HEADER}{}", "\"a,".repeat(100_000)));
        assert_eq!(
            m,
            "traces/x.csv:2: line is longer than the limit of 4096 bytes"
        );
    }

    #[test]
    fn huge_files_are_refused_before_reading() {
        // A sparse file: over the limit in length, no data on disk.
        let path = scratch("huge.csv");
        let file = File::create(&path).unwrap();
        file.set_len(MAX_FILE_BYTES + 1).unwrap();
        drop(file);
        let result = read_trace(&path);
        std::fs::remove_file(&path).unwrap();
        let m = result.unwrap_err().to_string();
        assert_eq!(
            m,
            format!(
                "{}: trace is larger than the limit of 1073741824 bytes",
                path.display()
            )
        );
        assert!(check_size("x", MAX_FILE_BYTES).is_ok());
    }

    #[test]
    fn invalid_utf8_names_the_line() {
        let path = scratch("latin1.csv");
        let mut bytes = HEADER.as_bytes().to_vec();
        bytes.extend_from_slice(b"2023-01-01 00:00:00,1,1\n2023-01-01 00:00:00,\xff,1\n");
        std::fs::write(&path, bytes).unwrap();
        let result = read_trace(&path);
        std::fs::remove_file(&path).unwrap();
        let m = result.unwrap_err().to_string();
        assert_eq!(m, format!("{}:3: not valid UTF-8", path.display()));
    }

    #[test]
    fn reads_a_file_from_disk() {
        let path = scratch("small.csv");
        std::fs::write(&path, format!("{HEADER}2023-01-01 00:00:00,1,2\n")).unwrap();
        let result = read_trace(&path);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(result.unwrap().rows.len(), 1);
    }

    /// The real Azure code trace (see shared/traces/README.md), which users bring: without it
    /// the test is reported skipped by name (a failure where `SLACKGATE_FORBID_SKIPS` is set,
    /// as in CI, since the simulator's published figures depend on it).
    #[test]
    fn reads_the_azure_code_trace() {
        let Some(path) =
            slackgate_testkit::production_trace("trace::tests::reads_the_azure_code_trace")
        else {
            return;
        };
        let trace = read_trace(&path).unwrap_or_else(|e| panic!("the shared trace must load: {e}"));
        // The README says 8,818 requests (a `wc -l` count); the file holds 8,819 data rows
        // after its header and has no final newline.
        assert_eq!(trace.rows.len(), 8_819);
        let span_s = trace.span_ms / 1000.0;
        assert!((3000.0..4000.0).contains(&span_s), "span {span_s} s");
        assert!(trace
            .rows
            .windows(2)
            .all(|w| w[0].offset_ms <= w[1].offset_ms));
        let median = |mut xs: Vec<u32>| {
            xs.sort_unstable();
            xs[xs.len() / 2]
        };
        let p50_prompt = median(trace.rows.iter().map(|r| r.prompt_tokens).collect());
        let p50_output = median(trace.rows.iter().map(|r| r.output_tokens).collect());
        assert!(
            (1_440..=1_500).contains(&p50_prompt),
            "p50 prompt {p50_prompt}"
        );
        assert!((12..=14).contains(&p50_output), "p50 output {p50_output}");
        let max_output = trace.rows.iter().map(|r| r.output_tokens).max();
        assert_eq!(max_output, Some(1_899));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Any text, and CSV-like text after a valid header, gives rows or an error naming a
        /// line of the file: never a panic.
        #[test]
        fn any_text_gives_rows_or_a_located_error(
            body in "[0-9a-zA-Z:. ,\"\r\n-]{0,300}",
            junk in proptest::prelude::any::<String>(),
        ) {
            for text in [format!("{HEADER}{body}"), junk] {
                match parse_trace("t.csv", &text) {
                    Ok(trace) => {
                        let lines = text.split('\n').count();
                        proptest::prop_assert!(trace.rows.iter().all(|r| (2..=lines).contains(&r.line)));
                    }
                    Err(e) => {
                        let m = e.to_string();
                        let line: usize = m
                            .strip_prefix("t.csv:")
                            .and_then(|r| r.split(':').next())
                            .and_then(|n| n.parse().ok())
                            .unwrap_or(0);
                        proptest::prop_assert!(line >= 1 && line <= text.split('\n').count(), "{}", m);
                    }
                }
            }
        }
    }
}
