//! Everything weft prints on stdout goes through here, so a closed pipe or a full disk
//! becomes an error the command returns instead of a panic inside `println!`.

use std::fmt;
use std::io::{self, Write};

/// A failed write to standard output. `main` ends quietly on a broken pipe (the reader
/// has all it wanted, as with `| head`) and reports anything else in one line.
#[derive(Debug)]
pub struct StdoutError(pub io::Error);

impl fmt::Display for StdoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "writing to standard output: {}", self.0)
    }
}

impl std::error::Error for StdoutError {}

impl StdoutError {
    pub fn is_broken_pipe(&self) -> bool {
        self.0.kind() == io::ErrorKind::BrokenPipe
    }
}

/// Writes `args` to stdout and flushes, so a failure shows at the write that caused it.
pub fn write_fmt(args: fmt::Arguments<'_>) -> Result<(), StdoutError> {
    let mut o = io::stdout().lock();
    o.write_fmt(args)
        .and_then(|()| o.flush())
        .map_err(StdoutError)
}

/// Writes a piece of text as is (streamed generation).
pub fn write_str(s: &str) -> Result<(), StdoutError> {
    write_fmt(format_args!("{s}"))
}

/// `println!` that returns `Result<(), StdoutError>` for the caller to propagate with `?`.
macro_rules! outln {
    () => {
        $crate::out::write_fmt(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::write_fmt(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// How `main` ends on `err`: None for a broken stdout pipe (exit 0, nothing printed),
/// else the exit code after printing the error.
pub fn exit_code(err: &anyhow::Error) -> Option<i32> {
    let stdout = err.chain().find_map(|e| e.downcast_ref::<StdoutError>());
    match stdout {
        Some(e) if e.is_broken_pipe() => None,
        _ => Some(1),
    }
}
